"""ram_trl/analysis/render.py: the table rows of ``analysis.md`` and the terminal summary, from hand-made agent
records (the whole ``analysis.md`` of a real run is checked in tests/test_analysis.py)."""

from __future__ import annotations

from ram_trl.analysis.render import magnitude_rows, sparsity_rows


def _agent(name: str, **changes) -> dict:
    agent = {
        "name": name,
        "kind": "full",
        "dtypes": ["bfloat16", "int64"],
        "density": 0.123456,
        "density_exact": 0.5,
        "density_bf16": None,
        "unique": 1234567,
        "shared": 0,
        "rho": 0.25,
        "lambda": {"ram_plus": 1.0 + 0.1 * 0.25, "ram_plus_soft": "inf"},
        "magnitude": {
            "count": 1000,
            "mean_abs": 0.000123456,
            "gini": 0.5,
            "excess_kurtosis": None,
            "top_1pct_mass": 0.0456,
            "top_5pct_mass": 1.0,
        },
    }
    agent.update(changes)
    return agent


def test_sparsity_rows():
    result = {"agents": [_agent("coding"), _agent("tools", kind="lora", rho=None)]}
    header, rows = sparsity_rows(result)
    assert header == ["agent", "dtype", "density", "exact", "bf16", "unique", "shared", "rho", "lam RAM+", "lam RAM+s"]
    assert rows[0] == ["coding", "bf16/int64", "12.35%", "50.00%", "-", "1,234,567", "0", "0.250", "1.0250", "inf"]
    assert rows[1][:2] == ["tools", "LoRA"] and rows[1][7] == "-"


def test_magnitude_rows():
    header, rows = magnitude_rows({"agents": [_agent("coding")]})
    assert header == ["agent", "active", "mean abs(tau)", "Gini", "ex. kurtosis", "top 1% mass", "top 5% mass"]
    assert rows == [["coding", "1,000", "0.000123", "0.5000", "-", "4.6%", "100.0%"]]


def test_the_terminal_tables_fit_80_columns(capsys, monkeypatch):
    # a 7B-scale agent: counts in the billions; every column (shared included) is whole in an 80-column terminal
    from ram_trl.analysis.render import print_tables

    monkeypatch.setenv("COLUMNS", "80")
    agent = _agent("RL-MemoryAgent-7B", dtypes=["bfloat16"], unique=1_234_567_890, shared=6_543_210_987)
    result = {
        "agents": [agent, _agent("ReasonFlux-Coder-7B", dtypes=["bfloat16"], unique=98_765, shared=12_345_678)],
        "num_agents": 2,
        "total_elements": 7_615_616_512,
        "tensors": 339,
        "parameters": {"eps": 1e-5},
        "warnings": [],
    }
    print_tables(result)
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out
    lines = [line.split() for line in out.splitlines()]
    assert ["RL-MemoryAgent-7B", "bf16", "12.35%", "50.00%", "1.23G", "6.54G", "0.250", "1.0250", "inf"] in lines
    assert ["ReasonFlux-Coder-7B", "bf16", "12.35%", "50.00%", "98,765", "12.3M", "0.250", "1.0250", "inf"] in lines
    assert any("shared" in line for line in lines)  # the columns without any value ("bf16": "-") are left out
