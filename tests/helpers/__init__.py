"""What several test files share: the session's pool of multi-process runs, ranks forked from a server that has
imported the project once, and in-process calls of the entry points. Scripts run as subprocesses also live here."""
