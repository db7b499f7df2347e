"""The ``twell`` command line: help texts, ``demo`` end to end, ``run``, ``bench`` forwarding, and
the one-line usage errors (exit status 2) for flags a user can get wrong.

Help and the demo run the installed console script when it is on disk (else ``python -m
twell_compile.cli``) in a subprocess; the error paths that never start training also run in
process, which is faster.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from twell_compile import cli, demo

_SCRIPT = Path(sys.executable).with_name("twell")
TWELL = [str(_SCRIPT)] if _SCRIPT.exists() else ([shutil.which("twell")] if shutil.which("twell") else [sys.executable, "-m", "twell_compile.cli"])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWELL")}  # the runner's own TWELL_* stay out
    env.update(extra)
    return env


def twell(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*TWELL, *args], capture_output=True, text=True, env=env or _env(), timeout=timeout)


# ---------------------------------------------------------------------------------------------
# help and version
# ---------------------------------------------------------------------------------------------


def test_help_lists_every_command():
    r = twell("--help")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for command in ("demo", "run", "bench"):
        assert f"\n    {command} " in out, out
    assert 'backend="twell"' in out and "TWELL=1" in out
    assert "twell run train.py" in out  # the examples section


def test_demo_help_explains_each_flag():
    r = twell("demo", "--help")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for flag in ("--steps", "--device", "--inner", "--l1", "--seed", "--plot", "--model", "--threads", "--tiny"):
        assert flag in out, flag
    assert "{auto,cpu,cuda}" in out and "{inductor,aot_eager,eager}" in out
    assert "aot_eager on cpu" in out  # why the CPU default differs


def test_run_help_and_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "TWELL=1" in out and "--l1" in out and "--strict" in out and "-m MODULE" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("twell 0.1.0") and f"torch {torch.__version__}" in out


def test_no_command_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------------


def test_demo_runs_and_prints_report_and_table():
    r = twell("demo", "--tiny", "--steps", "3", "--inner", "eager", "--no-progress")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    # the setup, with the inner compiler and why
    assert "inner   eager (--inner)" in out
    assert "L1      coefficient 0.005" in out
    # the rewrite report before training
    assert "twell: rewrote 2 FFN(s), skipped 0" in out
    assert out.count("twell::ffn_train") == 2
    assert out.index("twell::ffn_train") < out.index("step  L1 coeff")
    # the checkpoint table: one row per step here, step 1 dense (~50% active, all rows dense)
    table = out[out.index("step  L1 coeff") :].splitlines()
    assert table[0].split()[:8] == ["step", "L1", "coeff", "loss", "L0", "active", "L1", "dense"]
    rows = [line.split() for line in table[2:5]]
    assert [row[0] for row in rows] == ["1", "2", "3"]
    assert rows[0][1] == "0"  # the warm-up starts at 0
    assert 30.0 < float(rows[0][4].rstrip("%")) < 70.0 and rows[0][6] == "100%"
    # the per-layer stats, the inference op and the exactness line
    assert "twell_compile.stats() after the last step:" in out
    assert "its 2 FFNs run twell::ffn." in out
    rel = float(out.split("relative error of ")[1].split(":")[0])
    assert rel < 1e-5
    assert "graphs compiled after step 1: 0" in out


def test_demo_builtin_model_in_process(capsys):
    """The fallback decoder (for machines without transformers) is rewritten and trained too."""
    hist = demo.run(demo.DemoConfig(**{**demo.TINY, "steps": 2, "inner": "eager", "model": "builtin"}), progress=False)
    out = capsys.readouterr().out
    assert "model   built-in decoder" in out
    assert "rewrote 2 FFN(s)" in out and "blocks.0.mlp" in out and "blocks.1.mlp" in out
    assert hist.step == [1, 2] and all(v == v for v in hist.l0 + hist.l1)  # no NaN: the ops reported
    assert 0.3 * 256 < hist.l0[0] < 0.7 * 256  # ReLU at init: about half the neurons fire


def test_l1_warmup_schedule():
    cfg = demo.DemoConfig(steps=60, l1=5e-3)
    assert cfg.warmup == 12
    assert cfg.l1_at(1) == 0.0 and cfg.l1_at(7) == pytest.approx(2.5e-3) and cfg.l1_at(13) == cfg.l1_at(60) == 5e-3


def test_plot_writes_png(tmp_path):
    import matplotlib  # noqa: F401  (a test dependency: the plot must be drawn)
    hist = demo.History(step=[1, 2, 3], loss=[5.0, 4.0, 3.0], l0=[250.0, 100.0, 10.0], l1=[8.0, 3.0, 0.5], coeff=[0, 1e-3, 2e-3], dense_rows=[1.0, 0.5, 0.0])
    path = tmp_path / "demo.png"
    demo.plot(hist, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_importable", lambda name: name != "matplotlib")
    assert cli.main(["demo", "--plot", "out.png"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "twell demo: error: --plot needs matplotlib, which is not installed: pip install matplotlib"


# ---------------------------------------------------------------------------------------------
# usage errors: one line naming the flag, exit status 2
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf"])
def test_bad_l1_names_the_flag(value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", f"--l1={value}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    assert err.startswith("twell demo: error: argument --l1: expected a finite float >= 0") and repr(value) in err


def test_bad_l1_subprocess_exit_2():
    r = twell("run", "--l1", "lots", "script.py")
    assert r.returncode == 2
    assert r.stdout == "" and r.stderr.count("\n") == 1
    assert "twell run: error: argument --l1:" in r.stderr and "'lots'" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_but_absent():
    r = twell("demo", "--device", "cuda")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("twell demo: error: --device cuda: CUDA is not available")
    assert "use --device cpu or --device auto" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["demo", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["demo", "--inner", "xla"], "argument --inner: invalid choice: 'xla'"),
        (["demo", "--steps", "0"], "argument --steps: expected a whole number >= 1, got '0'"),
        (["run", "--inner", "fast", "x.py"], "argument --inner: invalid choice: 'fast'"),
    ],
)
def test_other_bad_flags(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err, err


# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------

SHOW_ENV = textwrap.dedent(
    """
    import os, sys
    print("TWELL=" + os.environ["TWELL"])
    for name in ("TWELL_L1", "TWELL_STRICT", "TWELL_INNER"):
        print(name + "=" + os.environ.get(name, "<unset>"))
    print("argv=" + repr(sys.argv[1:]))
    sys.exit(int(os.environ.get("EXIT_WITH", "0")))
    """
)


@pytest.fixture
def show_env(tmp_path) -> Path:
    path = tmp_path / "show_env.py"
    path.write_text(SHOW_ENV)
    return path


def test_run_sets_twell_and_passes_args_untouched(show_env):
    """Through the console script: everything after the script name reaches it untouched."""
    r = twell("run", str(show_env), "--lr", "3e-4", "-x", "--help", "--", "plain")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "TWELL=1"
    assert "TWELL_L1=<unset>" in lines and "TWELL_STRICT=<unset>" in lines
    assert lines[-1] == "argv=['--lr', '3e-4', '-x', '--help', '--', 'plain']"


@pytest.fixture
def clean_env(monkeypatch):
    for name in [k for k in os.environ if k.startswith("TWELL")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_run_flags_and_passthrough_of_twell_vars(show_env, clean_env, capfd):
    clean_env.setenv("TWELL_INNER", "aot_eager")
    assert cli.main(["run", "--l1", "1e-3", "--strict", str(show_env), "a"]) == 0
    assert capfd.readouterr().out.splitlines() == ["TWELL=1", "TWELL_L1=0.001", "TWELL_STRICT=1", "TWELL_INNER=aot_eager", "argv=['a']"]
    assert "TWELL" not in os.environ  # only the child's environment changed


def test_run_returns_the_script_exit_code(show_env, clean_env, capfd):
    clean_env.setenv("EXIT_WITH", "3")
    assert cli.main(["run", str(show_env)]) == 3
    assert capfd.readouterr().out.startswith("TWELL=1")


def test_run_module(show_env, clean_env, capfd):
    clean_env.chdir(show_env.parent)
    assert cli.main(["run", "--l1", "2e-5", "-m", "show_env", "--l1", "3", "--strict", "b"]) == 0
    lines = capfd.readouterr().out.splitlines()
    # twell's --l1 is ours; everything after the module name is the module's
    assert lines == ["TWELL=1", "TWELL_L1=2e-05", "TWELL_STRICT=<unset>", "TWELL_INNER=<unset>", "argv=['--l1', '3', '--strict', 'b']"]


def test_run_usage_errors(tmp_path, capsys, clean_env):
    missing = tmp_path / "missing.py"
    assert cli.main(["run", str(missing)]) == 2
    assert capsys.readouterr().err == f"twell run: error: script {str(missing)!r} not found\n"
    assert cli.main(["run"]) == 2
    assert "no script given" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--verbose", "train.py"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "twell run: error: unrecognized option '--verbose' before the script (see twell run --help)\n"
    script = tmp_path / "s.py"
    script.write_text("print('must not run')\n")
    clean_env.setenv("TWELL_L1", "fast")
    assert cli.main(["run", str(script)]) == 2
    err = capsys.readouterr()
    assert err.out == "" and "TWELL_L1='fast' is not a number" in err.err
    clean_env.delenv("TWELL_L1")
    for name, value, says in (("TWELL_PLAIN_LAUNCH", "2", "TWELL_PLAIN_LAUNCH='2'"),
                              ("TWELL_CALL_REPLAY", "on", "TWELL_CALL_REPLAY='on'"),
                              ("TWELL_L1_COEF", "1e-3", "TWELL_L1_COEF is not a twell variable")):
        clean_env.setenv(name, value)
        assert cli.main(["run", str(script)]) == 2, name
        err = capsys.readouterr()
        assert err.out == "" and says in err.err, err.err
        clean_env.delenv(name)


# ---------------------------------------------------------------------------------------------
# bench forwarding
# ---------------------------------------------------------------------------------------------


def test_bench_forwards_every_argument(monkeypatch):
    seen = []
    fake = types.ModuleType("twell_compile.bench")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "twell_compile.bench", fake)
    assert cli.main(["bench", "--help", "--density", "0.01", "-o", "out.csv"]) == 7
    assert seen == [["--help", "--density", "0.01", "-o", "out.csv"]]


def test_bench_missing_module_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "twell_compile.bench", None)  # import fails as if the file were absent
    assert cli.main(["bench"]) == 2
    assert capsys.readouterr().err == "twell bench: error: the benchmark (twell_compile.bench) is not part of this install yet\n"


def test_bench_help_is_the_benchmarks_own(capsys):
    import twell_compile.bench  # noqa: F401
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and "Forwards every argument" not in out  # bench parsed --help, not us
