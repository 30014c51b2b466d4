"""synccheck profiler bootstrap (put first on PYTHONPATH by `synccheck profile`).

Python imports `sitecustomize` at start-up in every interpreter that inherits PYTHONPATH: the torchrun
agent, each worker, `mp.spawn` children, and also any unrelated Python tool the command runs. So this
file does almost nothing eagerly:

1. it installs a meta-path finder that only reacts to the import of `torch` (one dict lookup per
   import otherwise) and, once `import torch` has *finished*, imports the real hooks
   (`synccheck.profiler.hooks`); torch is never imported from here;
2. it runs the `sitecustomize` that would have run without us (the ddtrace-run convention), so a
   user's or the distribution's sitecustomize still takes effect.

Standard library only, and it must never raise: a profiler that breaks start-up is worse than none.
"""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


class _PostImportFinder:
    """Runs callbacks once a watched module has been executed (a post-import hook).

    It finds the module's spec through the other finders and wraps that spec's loader's exec_module, so
    the module keeps its own loader (importlib.resources and inspect keep working)."""

    _synccheck_finder = True

    def __init__(self):
        self.callbacks = {}
        self._busy = set()

    def when_imported(self, name, callback):
        module = sys.modules.get(name)
        if module is not None:
            callback(module)
        else:
            self.callbacks.setdefault(name, []).append(callback)

    def find_spec(self, name, path=None, target=None):
        if name not in self.callbacks or name in self._busy:
            return None
        self._busy.add(name)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        callbacks = self.callbacks.pop(name)
        exec_module = loader.exec_module

        def exec_then_hook(module):
            exec_module(module)
            for callback in callbacks:
                try:
                    callback(module)
                except Exception as exc:  # pragma: no cover - reported, never raised
                    sys.stderr.write("synccheck: profiler hook failed: %s: %s\n" % (type(exc).__name__, exc))

        loader.exec_module = exec_then_hook
        return spec


def _on_torch_imported(_torch_module):
    try:
        from synccheck.profiler import hooks
    except Exception as exc:
        sys.stderr.write(
            "synccheck: this interpreter (%s) cannot import synccheck (%s); it is not profiled\n"
            % (sys.executable, exc))
        return
    try:
        hooks.install(_FINDER.when_imported)
    except Exception as exc:
        sys.stderr.write("synccheck: profiler hooks not installed: %s: %s\n" % (type(exc).__name__, exc))


def _chain_sitecustomize():
    """Import the sitecustomize this interpreter would have imported had our folder not come first."""
    import importlib.machinery
    import importlib.util

    # Our folder was only needed to be found as `sitecustomize`; the user's code should not see it.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return
    ours = sys.modules.get("sitecustomize")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        # What site.py itself does with a failing sitecustomize: one line, and start-up goes on.
        sys.modules["sitecustomize"] = ours
        sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n%s: %s\n"
                         % (type(exc).__name__, exc))


_FINDER = None
if os.environ.get("SYNCCHECK_PROFILE_OUT"):
    _FINDER = _PostImportFinder()
    if "torch" in sys.modules:  # a .pth file imported torch already
        _on_torch_imported(sys.modules["torch"])
    else:
        _FINDER.callbacks["torch"] = [_on_torch_imported]
        sys.meta_path.insert(0, _FINDER)
try:
    _chain_sitecustomize()
except Exception as _exc:  # pragma: no cover
    sys.stderr.write("synccheck: could not run the original sitecustomize: %s\n" % (_exc,))
