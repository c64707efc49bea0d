"""Import every module of the project alone, each into an interpreter emptied of the project's modules, and report
every import circle as it happens: an import statement that names a module still executing (Python's
`__spec__._initializing`), the partially initialised module a circle hands over. Prints one JSON object:
{"modules": [...], "circles": [[importer, imported], ...], "errors": {module: message}}.

argv: a root directory, its comma-separated packages as folder=module (objectives=ssl_vit.objectives: a folder the
package maps elsewhere; a folder alone is its own name), and optionally "i/n": every n-th module from the
i-th (so n processes share the modules; each is imported alone either way). Third-party modules stay loaded between
modules (only the project's are emptied), so the run takes seconds; each project module still starts from nothing,
in an order where a circle cannot hide behind an earlier import."""

import builtins
import importlib
import json
import sys
from importlib.machinery import PathFinder
from pathlib import Path

root = Path(sys.argv[1])
FOLDERS = dict(item.split("=") if "=" in item else (item, item) for item in sys.argv[2].split(","))
PACKAGES = {module.split(".")[0] for module in FOLDERS.values()}
sys.path.insert(0, str(root))
modules = sorted(
    ".".join((module, *path.relative_to(root / folder).with_suffix("").parts)).removesuffix(".__init__")
    for folder, module in FOLDERS.items() for path in (root / folder).rglob("*.py"))
if len(sys.argv) > 3:
    part, parts = map(int, sys.argv[3].split("/"))
    modules = modules[part::parts]
circles, errors = set(), {}
original_import = builtins.__import__


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _initializing(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False)


def traced_import(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__", "?")
    if level == 0 and _ours(name) and _ours(importer) and name in sys.modules:
        package_path = getattr(sys.modules[name], "__path__", None)
        # `from package import submodule` names the submodule, `from package import attribute` the package
        targets = {f"{name}.{item}" if package_path and PathFinder.find_spec(item, package_path) else name
                   for item in fromlist or ()} or {name}
        circles.update((importer, target) for target in targets if target != importer and _initializing(target))
    return original_import(name, globals, locals, fromlist, level)


builtins.__import__ = traced_import
for module in modules:
    for loaded in [m for m in sys.modules if _ours(m)]:
        del sys.modules[loaded]
    try:
        importlib.import_module(module)
    except Exception as err:  # reported, not raised: every module gets its turn
        errors[module] = f"{type(err).__name__}: {err}"
print(json.dumps({"modules": modules, "circles": sorted(circles), "errors": errors}))
