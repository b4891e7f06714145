"""Post-import patch for the real-engine tier's SGLang processes (on their PYTHONPATH only).

SGLang 0.5.23's Mooncake sender declares `supports_host_tensor_indices = True`
(`disaggregation/mooncake/conn.py`), which makes the prefill's send path
(`disaggregation/prefill.py`) copy the KV page indices to pinned memory and record a
`torch.cuda.Event`; on a CPU-only engine that raises on the first request. With the flag off the
prefill takes its other, device-neutral branch (`kv_to_page_indices`). SGLang's files are left
untouched: the attribute is set on the class right after its module has been imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_TARGET = "sglang.srt.disaggregation.mooncake.conn"


def _patch(module) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the target module through the normal path finder and patches it once executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            _patch(module)

        loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
