"""hivemind's networking without hivemind's package init, until something asks for the rest.

`import hivemind.p2p` first runs hivemind/__init__.py, which imports every hivemind subsystem to
offer their names at the top: the averager (and with it scipy.optimize), mixture-of-experts
servers, the optimizer. bloompeer uses hivemind.p2p, hivemind.dht and hivemind.utils, which need
none of them; the init alone costs each process about 0.5 s of CPU at start (after torch).

install() puts the hivemind package in sys.modules with its __init__ not run yet. Its submodules
import as usual. The first look-up of a name the init would have set (hivemind.DHT,
hivemind.__version__, `from hivemind import Optimizer`) runs the init then, so a program that
uses the rest of hivemind sees no difference, only when the cost comes.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types

__all__ = ["install"]

_running_init = threading.local()  # set in a thread while it runs the init


class _HivemindPackage(types.ModuleType):
    def __getattr__(self, name: str):
        """Only for names not set yet: a submodule still being imported (`import hivemind.p2p.x as y`
        looks it up here before it is set), or else a name of the package init: run it, then look
        the name up as usual. The init is only `from hivemind.x import y` lines and the version, so
        threads that ask at once may each run it; the import system makes them wait for each other
        on each submodule (with its deadlock detection, which a lock of ours would not have)."""
        submodule = sys.modules.get(f"{self.__name__}.{name}")
        if submodule is not None:
            return submodule
        if getattr(_running_init, "active", False):  # the init itself looked up a name it has not set
            raise AttributeError(f"partially initialized module 'hivemind' has no attribute {name!r}")
        _running_init.active = True
        try:
            self.__spec__.loader.exec_module(self)
        finally:
            _running_init.active = False
        self.__class__ = types.ModuleType  # a plain module from now on
        return getattr(self, name)


def install() -> None:
    """Before the first import of hivemind; does nothing once it is imported, or if it is not installed."""
    if "hivemind" in sys.modules:
        return
    spec = importlib.util.find_spec("hivemind")
    if spec is None:
        return  # the import will fail as it would have
    package = importlib.util.module_from_spec(spec)
    package.__class__ = _HivemindPackage
    sys.modules["hivemind"] = package
