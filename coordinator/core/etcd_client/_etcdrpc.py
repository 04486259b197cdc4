"""etcd's generated gRPC code (python3-etcd3's ``etcd3.etcdrpc``), without python3-etcd3's
client.

``from etcd3 import etcdrpc`` first runs ``etcd3/__init__.py``, which imports python3-etcd3's
own client (``etcd3.client``, ``locks``, ``watch``, ``leases``, and with them ``uuid`` and
``platform``): about 15 ms of CPU at every start of ``rdzvctl``, for code this package
never uses (docs/decisions/etcd-client.md: we use only the stubs and messages). So the
``etcdrpc`` folder of the installed python3-etcd3 is loaded here as a package of its own,
:data:`PACKAGE`, from the same files (and their bytecode cache): ``rpc_pb2``,
``kv_pb2``, ``auth_pb2`` and ``rpc_pb2_grpc``, nothing else.

The messages are the same classes as ``etcd3.etcdrpc``'s (protobuf keeps one class per
message type, and both copies register the same ``rpc.proto``), so code that also imports
``etcd3`` (some tests do) can mix the two; only the stub classes (``KVStub`` …) are
separate, equal copies. Should a later python3-etcd3 import its stubs by absolute name,
this still works: it then loads the whole package, as ``from etcd3 import etcdrpc`` does.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

__all__ = ["PACKAGE", "etcdrpc"]

PACKAGE = "coordinator.core.etcd_client._etcd3_etcdrpc"
"""The name the generated code is loaded under (a package in ``sys.modules`` only)."""


def _load() -> ModuleType:
    found = importlib.util.find_spec("etcd3")  # a top-level name: finds, does not import
    folders = found.submodule_search_locations if found is not None else None
    if not folders:
        raise ImportError(
            "python3-etcd3 is not installed (etcd's generated gRPC code comes from it): "
            "pip install 'python3-etcd3>=0.13.0'"
        )
    folder = os.path.join(folders[0], "etcdrpc")
    spec = importlib.util.spec_from_file_location(
        PACKAGE, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"python3-etcd3 has no etcdrpc package in {folder}; reinstall it")
    package = importlib.util.module_from_spec(spec)
    # In sys.modules before it runs: its "from .rpc_pb2 import *" finds its parent there.
    sys.modules[PACKAGE] = package
    try:
        spec.loader.exec_module(package)
    except BaseException:
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]
        raise
    return package


# Once, when this module is first imported (its import lock keeps two threads from both
# loading it).
etcdrpc: Any = _load()
