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

_init_lock = threading.RLock()  # a thread that looks up a name while another runs the init waits for it


class _HivemindPackage(types.ModuleType):
    _init_running = False

    def __getattr__(self, name: str):
        """Only for names not set yet: a submodule still being imported (`import hivemind.p2p.x as y`
        looks it up here before it is set), or else a name of the package init: run it (once), then
        look the name up as usual."""
        submodule = sys.modules.get(f"{self.__name__}.{name}")
        if submodule is not None:
            return submodule
        with _init_lock:
            if type(self) is _HivemindPackage and not _HivemindPackage._init_running:
                _HivemindPackage._init_running = True
                try:
                    self.__spec__.loader.exec_module(self)
                    self.__class__ = types.ModuleType
                finally:
                    _HivemindPackage._init_running = False
        if type(self) is _HivemindPackage:  # the init itself (in this thread) looked up a name it has not set
            raise AttributeError(f"partially initialized module 'hivemind' has no attribute {name!r}")
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
