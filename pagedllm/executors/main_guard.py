"""Whether the script being run would start this engine again in a process started with
multiprocessing's ``spawn``.

Such a process imports the script again (as ``__mp_main__``) before it runs anything
else, and so runs every line that is not under ``if __name__ == "__main__":``. When the
engine is being started from such a line, each worker would start an engine of its
own: Python stops it with a RuntimeError in the worker, which the engine would only see
as a worker that exited. Finding the line here lets the engine refuse at once, naming it.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path


def unguarded_call_site() -> tuple[str, int] | None:
    """``(path, line)`` of the script's top-level line that is running now (the one that
    led to this call), when a spawned process would run it too; None when it would not
    (it is under the guard, or the script is not imported again: ``python -c``, the
    interpreter's prompt, a package's ``__main__``), or when this call does not come from
    the script's top level (a thread's)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None:
        return None
    name = getattr(getattr(main, "__spec__", None), "name", None)
    # (As multiprocessing.spawn decides whether to import the script again.)
    if name is not None and (name == "__main__" or name.endswith(".__main__")):
        return None
    if name is None and Path(path).stem == "ipython":
        return None
    frame = sys._getframe(1)
    while frame is not None and not (
        frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"
    ):
        frame = frame.f_back
    if frame is None:
        return None
    line = frame.f_lineno
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    if _guarded(tree, line):
        return None
    return os.path.abspath(path), line


def _guarded(tree: ast.Module, line: int) -> bool:
    """Whether ``line`` lies in the branch of an ``if __name__ == "__main__":`` (or
    ``!=``) that an import does not take."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        equal = _main_test(node.test)
        if equal is None:
            continue
        branch = node.body if equal else node.orelse
        if branch and branch[0].lineno <= line <= (branch[-1].end_lineno or line):
            return True
    return False


def _main_test(test: ast.expr) -> bool | None:
    """True for ``__name__ == "__main__"``, False for ``!=`` (either order), else None."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    values = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    if not (names and values):
        return None
    if isinstance(test.ops[0], ast.Eq):
        return True
    if isinstance(test.ops[0], ast.NotEq):
        return False
    return None
