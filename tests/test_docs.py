"""Every documented command stays true: each command line of README.md and docs/ (`ssl-vit ...`, `python
scripts/...`, `python benchmarks/...`, `accelerate launch ... scripts/pretrain.py ...`, `make run ARGS=...`) has its
configuration composed and validated (Hydra scripts) or its arguments parsed (argparse scripts), without running
it; a renamed key, option or flag fails here. The site builds with mkdocs --strict (no broken link or anchor)."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT

from ssl_vit.cli import POSITIONAL, _compose_job, register_configs
from ssl_vit.commands import COMMANDS
from ssl_vit.launch import shipped_config
from ssl_vit.schema import validate_config

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
HYDRA_SCRIPTS = {"pretrain": "pretrain", "evaluate": "evaluate", "linear_probe": "evaluate",
                 "plan_memory": "plan_memory", "benchmark": "benchmark"}
PLACEHOLDER = re.compile(r"<[a-z][^<>]*>")  # <run>, <clip run>, <that run>
RUN = "/tmp/documented-run"  # what a placeholder stands for (composing reads no file)


def documented_commands() -> list[tuple[str, str]]:
    """(page:line, command) of every line in a ```bash block that starts one of ours (one command per `&&`)."""
    found = []
    for page in PAGES:
        in_bash, pending, start = False, "", 0
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_bash = line.strip() in ("```bash", "```sh", "```shell")
                continue
            if not in_bash:
                continue
            if not pending:
                start = number
            if line.rstrip().endswith("\\"):  # a continued command: the shell reads it as one line
                pending += line.rstrip()[:-1] + " "
                continue
            line, pending = pending + line, ""
            for words in _shell_commands(PLACEHOLDER.sub(RUN, line.strip())):
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value prefixes
                    words = words[1:]
                if words and _ours(words):
                    found.append((f"{page.relative_to(ROOT)}:{start}", shlex.join(words)))
    return found


def _shell_commands(line: str) -> list[list[str]]:
    """The words of each command of a shell line (split at ;, &&, ||, |; quotes kept; a # comment dropped)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands = [[]]
    for token in lexer:
        if token in (";", "&&", "||", "|", "&"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [words for words in commands if words]


def _ours(words: list[str]) -> bool:
    if "--help" in words or "-h" in words or "--version" in words:
        return False  # nothing to compose (ssl-vit --help: tests/test_package.py)
    return (words[0] == "ssl-vit" or words[:2] == ["accelerate", "launch"] or words[0] == "torchrun"
            or (words[0].startswith("python") and len(words) > 1
                and (words[1].startswith(("scripts/", "benchmarks/")) or words[1:3] == ["-m", "ssl_vit"]))
            or (words[:2] == ["make", "run"] and any(w.startswith("ARGS=") for w in words)))


def resolve(words: list[str]) -> tuple[str, list[str]]:
    """(script module under scripts/ or benchmarks/<name>, its arguments) of a documented command."""
    if words[0] == "make":
        return "pretrain", shlex.split(next(w for w in words if w.startswith("ARGS=")).removeprefix("ARGS="))
    if words[0] in ("accelerate", "torchrun") or words[:2] == ["ssl-vit", "launch"]:
        words = _after_launcher(words)
    if words[0] == "ssl-vit":
        return COMMANDS[words[1]][0], words[2:]
    if words[0].startswith("python") and words[1] == "-m":
        return COMMANDS[words[3]][0], words[4:]
    script = Path(words[1])
    assert script.is_file() or (ROOT / script).is_file(), f"{script} does not exist"
    return (script.stem if script.parts[0] == "scripts" else f"benchmarks/{script.stem}"), words[2:]


def _after_launcher(words: list[str]) -> list[str]:
    """The command a launcher starts: its options checked (a shipped accelerate config, by path or name)."""
    start = 2 if words[0] != "torchrun" else 1
    index = start
    while index < len(words) and words[index].startswith("-") and words[index] != "-m":
        option = words[index].split("=", 1)
        value = option[1] if len(option) == 2 else words[index + 1]
        if option[0] == "--config_file":
            assert (ROOT / value).is_file() or Path(shipped_config(value, Path(tempfile.mkdtemp()))).is_file(), value
        index += 1 if len(option) == 2 else 2
    rest = words[index:]
    if rest[0] == "-m":
        return ["python", "-m", *rest[1:]]
    return ["ssl-vit", *rest] if rest[0] in COMMANDS else ["python", *rest]


class _Parsed(Exception):
    """Raised by argparse in place of running the script, once its arguments parsed."""


def parse_arguments(module_path: Path, argv: list[str], monkeypatch) -> argparse.Namespace:
    """The script's argparse result for `argv`; its main() stops there (a benchmark's main reads sys.argv)."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.syspath_prepend(str(module_path.parent))  # a benchmark's sibling modules
    monkeypatch.setattr(sys, "argv", [str(module_path), *argv])
    spec = importlib.util.spec_from_file_location(f"documented_{module_path.stem}", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(_Parsed) as parsed:
        module.main(argv) if inspect.signature(module.main).parameters else module.main()
    return parsed.value.args[0]


def compose_and_validate(config_name: str, argv: list[str]) -> None:
    positional = POSITIONAL.get(config_name)
    if positional and argv and "=" not in argv[0] and not argv[0].startswith("-"):
        argv = [f"{positional}={argv[0]}", *argv[1:]]
    overrides, skip = [], False
    for arg in argv:  # Hydra's own flags (--cfg job, --resolve) and hydra.* overrides left out
        if not skip and not arg.startswith("-") and not arg.startswith("hydra."):
            overrides.append(arg)
        skip = arg in ("--cfg", "-c", "--package", "-p")
    cfg = _compose_job(config_name, overrides)
    if "--cfg" in argv:  # Hydra prints the composed config: mandatory values may still be unset
        return
    if "output_dir" in cfg:  # Hydra's run directory, set when a job runs
        cfg.output_dir = "documented"
    validate_config(cfg)


COMMANDS_FOUND = documented_commands()


def test_the_pages_document_commands_of_every_kind():
    scripts = {resolve(shlex.split(command))[0] for _, command in COMMANDS_FOUND}
    assert len(COMMANDS_FOUND) >= 100
    assert {"pretrain", "evaluate", "export", "consolidate", "make_shards", "plan_memory"} <= scripts
    assert any(command.startswith("accelerate launch") for _, command in COMMANDS_FOUND)
    assert any(command.startswith("ssl-vit") for _, command in COMMANDS_FOUND)


@pytest.mark.parametrize("where, command", COMMANDS_FOUND, ids=[where for where, _ in COMMANDS_FOUND])
def test_a_documented_command_composes_or_parses(where, command, monkeypatch):
    if "hydra.searchpath=" in command:
        pytest.skip("a user's own config folder (docs/objectives/index.md: your own objective)")
    register_configs()
    script, argv = resolve(shlex.split(command))
    if script in HYDRA_SCRIPTS:
        compose_and_validate(HYDRA_SCRIPTS[script], argv)
    else:
        path = ROOT / (f"{script}.py" if script.startswith("benchmarks/") else f"scripts/{script}.py")
        parse_arguments(path, argv, monkeypatch)


def test_a_renamed_key_or_flag_fails_the_check(tmp_path, monkeypatch):
    register_configs()
    with pytest.raises(Exception, match="precison"):
        compose_and_validate("pretrain", ["objective=mae", "trainer.precison=bf16"])
    with pytest.raises(SystemExit):
        parse_arguments(ROOT / "scripts" / "export.py", ["run", "--to", "timm", "--output", "x"], monkeypatch)


@pytest.mark.slow
def test_the_docs_site_builds_without_a_warning(tmp_path):
    """mkdocs build --strict: every page in the nav, every link and anchor resolves (make docs)."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "objectives" / "dino" / "index.html").is_file()
