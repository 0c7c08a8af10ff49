"""``ram_trl.io.quiet``: transformers' progress bars off inside the block, the host's setting kept."""

from __future__ import annotations

import pytest
from transformers.utils import logging as hf_logging

from ram_trl.io.quiet import progress_bars_off


@pytest.mark.parametrize("host", [True, False])
def test_the_hosts_setting_is_restored_even_after_an_error(host):
    was = hf_logging.is_progress_bar_enabled()
    try:
        (hf_logging.enable_progress_bar if host else hf_logging.disable_progress_bar)()
        with pytest.raises(RuntimeError), progress_bars_off():
            assert not hf_logging.is_progress_bar_enabled()
            raise RuntimeError("while loading")
        assert hf_logging.is_progress_bar_enabled() is host
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
