"""Launches SGLang's serving benchmark client (`sglang.bench_serving`, 0.5.10) as a program: `python
tests/sglang_bench_client.py ARGS...` runs it with ARGS, unchanged.

The client itself needs only aiohttp, numpy, transformers and `datasets`, but it imports one helper class from
`sglang.srt.utils.network`, and importing that module runs the `sglang.srt.utils` package's `__init__`, which pulls
SGLang's GPU server stack (torchvision, CUDA kernels) that the project does not install. So the package is
registered here by its directory alone, without running its `__init__`: the client and `network.py` are SGLang's
own code, run as shipped."""
import importlib.util
import runpy
import sys
import types


def register_package_without_init(name: str, parent: str) -> None:
    """Make `name` (a subpackage of `parent`) importable from its directory without executing its __init__.py."""
    package = types.ModuleType(name)
    package.__path__ = [importlib.util.find_spec(parent).submodule_search_locations[0] + "/" + name.rsplit(".", 1)[1]]
    sys.modules[name] = package


if __name__ == "__main__":
    register_package_without_init("sglang.srt.utils", "sglang.srt")
    runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
