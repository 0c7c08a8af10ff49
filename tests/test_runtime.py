"""The command-line tools' process settings (ram_trl.runtime)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from ram_trl.runtime import tune_for_streaming


def test_tune_for_streaming_freezes_objects_and_tunes_glibc():
    try:
        applied = tune_for_streaming()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    if sys.platform.startswith("linux"):
        import platform

        if platform.libc_ver()[0] == "glibc":
            assert applied


_FAULTS = """
import resource, sys, torch
if sys.argv[1] == "tuned":
    import ram_trl.merging.engine  # as in `ram-trl merge`: the merge stack is imported before the process is tuned
    from ram_trl.runtime import tune_for_streaming

    tune_for_streaming()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(100):  # block temporaries of two sizes, as a merge's passes allocate them
    a = torch.ones(3 << 18)
    b = torch.ones(5 << 20)
    del a, b
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True)
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator settings")
def test_block_temporaries_reuse_heap_pages_after_tuning():
    # untuned, glibc maps fresh zero-filled pages for many of these allocations and returns them when freed
    tuned, untuned = _page_faults("tuned"), _page_faults("untuned")
    assert tuned < untuned / 2, (tuned, untuned)


@pytest.mark.parametrize("enabled", [True, False])
def test_import_restores_the_garbage_collector_state(enabled):
    code = f"import gc\nif not {enabled}:\n    gc.disable()\nimport ram_trl\nprint(gc.isenabled())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == str(enabled)


def test_gc_paused_restores_the_previous_state():
    from ram_trl.runtime import gc_paused

    was = gc.isenabled()
    try:
        for start in (True, False):
            gc.enable() if start else gc.disable()
            with gc_paused():
                assert not gc.isenabled()
            assert gc.isenabled() is start
        gc.enable()
        with pytest.raises(RuntimeError), gc_paused():
            raise RuntimeError("inside")
        assert gc.isenabled()
    finally:
        gc.enable() if was else gc.disable()


def test_the_command_line_restores_the_garbage_collector_state():
    code = "import gc\nfrom ram_trl.cli import main\nassert main(['methods']) == 0\nprint(gc.isenabled())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "True"
