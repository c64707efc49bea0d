"""Files others made (a colleague's checkpoint, downloaded weights, a cache), read without running their code.

A pickle names callables and their arguments, and unpickling calls them: a crafted `.pt` / `.pkl` runs whatever it
names. Readers of a user's file here go through `load_tensors` (torch.load with weights_only=True: tensors, plain
containers and the `allowed` globals), `restricted_unpickle` (a raw pickle, e.g. torch.distributed.checkpoint's
`.metadata`, with an allowlist of names checked before anything is imported), or a format that holds no code
(safetensors, JSON). A file that holds more is refused in one line naming it, what it wanted to call, and how to
trust it (`UntrustedFile`). `file_kind` names a file's format from its first bytes, for the messages of readers
given the wrong kind of file.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import re
import zipfile
from collections.abc import Iterable
from pathlib import Path

import torch

from ssl_vit.schema import ConfigError

# The lines of torch's weights_only refusal that say what the file wanted (the rest is advice about weights_only)
_REASON = re.compile(r"(Unsupported globals?|Trying to load|Unsupported operand|Can only|Unsupported class|"
                     r"Unsupported type|Unsupported argument|unsupported GLOBAL|is not an allowed global)[^\n]*")


class UntrustedFile(ConfigError):
    """A file holds Python objects beyond tensors and plain containers: reading it would run code it names."""


def describe_error(err: BaseException) -> str:
    """"Type: the first line of its message" (library messages run on for lines)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:160]}" if text else type(err).__name__


# how to trust a weights file that a library reads as weights only (no loader here unpickles it in full)
RESAVE_HINT = ("load it where you trust it and save its state dict with safetensors.torch.save_file, then name the "
               ".safetensors file")


def untrusted(file, reason: str, trust_hint: str) -> UntrustedFile:
    return UntrustedFile(f"{file} holds Python objects beyond tensors and plain containers ({reason[:200]}); "
                         f"reading it would run their code: if you trust the file, {trust_hint}")


def weights_only_refusal(err: BaseException | None) -> str | None:
    """What torch's weights_only unpickler refused in a file (one line), from `err` or the errors it was raised
    from (a library's wrapper: timm raises RuntimeError "weights_only=True blocked ..."), or None when none of them
    is that refusal (a damaged or foreign file)."""
    while err is not None:
        text = str(err)
        if (isinstance(err, pickle.UnpicklingError) and "Weights only load failed" in text) or \
                "weights_only=True blocked" in text:
            found = _REASON.search(text)
            return found.group(0).split(". ")[0].strip().rstrip(".") if found else "objects weights_only refuses"
        err = err.__cause__ or err.__context__
    return None


def load_tensors(source, trust_hint: str, trust_pickle: bool = False, allowed: Iterable = (), name: str | None = None,
                 **kwargs):
    """torch.load of `source` (a path or a file object) that should hold tensors, plain containers and the
    `allowed` globals only; UntrustedFile naming `source` (or `name`) and `trust_hint` (how to trust it) when it
    holds more.
    `trust_pickle`: unpickle in full (runs what the file names). Other errors (a damaged or foreign file) are
    torch's own."""
    kwargs.setdefault("map_location", "cpu")
    try:
        with torch.serialization.safe_globals([] if trust_pickle else list(allowed)):
            return torch.load(source, weights_only=not trust_pickle, **kwargs)
    except pickle.UnpicklingError as err:
        reason = weights_only_refusal(err)
        if reason is None:
            raise
        raise untrusted(name or source, reason, trust_hint) from err


@contextlib.contextmanager
def refusing_pickles(what: str):
    """Inside, a library loader's weights-only refusal (torch's UnpicklingError, timm's RuntimeError) becomes
    UntrustedFile naming `what` (a spec) and how to re-save the file; every other error is the library's own."""
    try:
        yield
    except Exception as err:
        reason = weights_only_refusal(err)
        if reason is None:
            raise
        raise untrusted(f"{what}: its weights file", reason, RESAVE_HINT) from err


class _AllowlistUnpickler(pickle.Unpickler):
    """pickle.Unpickler whose globals must be in `allowed` ("module.name" strings), checked before the module is
    imported; persistent ids (torch.save's storages) are refused."""

    def __init__(self, file, allowed: set[str]):
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        if f"{module}.{name}" not in self.allowed:
            raise pickle.UnpicklingError(f"unsupported global {module}.{name}")
        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("unsupported persistent id (a tensor storage outside torch.save's format)")


def restricted_unpickle(file: str | Path, allowed: set[str], trust_hint: str):
    """A raw pickle file whose globals are all in `allowed` ("module.name"); UntrustedFile otherwise. Other errors
    (truncated, not a pickle) are pickle's own."""
    try:
        with open(file, "rb") as f:
            return _AllowlistUnpickler(f, allowed).load()
    except pickle.UnpicklingError as err:
        if str(err).startswith("unsupported "):
            raise untrusted(file, str(err), trust_hint) from err
        raise


def dtype_globals() -> set[str]:
    """torch.float32 and its kin as pickles name them ("torch.float32")."""
    return {f"torch.{name}" for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}


def file_kind(path: str | Path) -> str:
    """The format of a file from its first bytes, in words: "safetensors", "a PyTorch file (torch.save)", "a
    pickle", "a NumPy file", "a zip archive", "JSON", "empty", or "unknown"."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as err:
        return f"unreadable ({err.strerror or err})"
    if not head:
        return "empty"
    if head[:4] == b"PK\x03\x04":
        return "a PyTorch file (torch.save)" if _is_torch_zip(path) else "a zip archive"
    if head[:1] == b"\x80" and len(head) > 1 and head[1] <= 5:
        return "a pickle (a legacy torch.save or pickle.dump)"
    if head[:6] == b"\x93NUMPY":
        return "a NumPy file"
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 100_000_000:
        return "safetensors"
    if head.lstrip()[:1] in (b"{", b"["):
        return "JSON"
    return "unknown"


def _is_torch_zip(path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


__all__ = ["RESAVE_HINT", "UntrustedFile", "describe_error", "dtype_globals", "file_kind", "load_tensors",
           "refusing_pickles", "restricted_unpickle", "untrusted", "weights_only_refusal"]
