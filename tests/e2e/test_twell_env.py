"""``TWELL=1`` for unmodified scripts (docs/architecture.md, 'TWELL=1'), and ``twell_compile.patch`` in process.

The scripts below never mention twell. Each runs in a subprocess with a clean environment (no
``TWELL*`` variable unless the test sets one) through a small runner, which afterwards reports
whether ``twell_compile.activate`` was imported and how many FFNs the backend rewrote.

The script's model has two FFNs:

* ``MLP``: an ``nn.Linear`` module (gate/up/down + ``nn.ReLU``), which the eager patch handles;
* ``Inline``: an FFN written inline with bare parameters, which only a compile route can rewrite.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import twell_compile
from twell_compile import SkipReason, TwellRewriteError

from tests.ffn_models import (
    GatedFFN,
    PlainFFN,
    ResidualStack,
    assert_close,
    assert_grads_close,
    eager_loss,
    reset_state,
)

MODEL_SRC = textwrap.dedent(
    """
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self, d=16, h=40):
            super().__init__()
            self.gate = nn.Linear(d, h)
            self.up = nn.Linear(d, h)
            self.down = nn.Linear(h, d)
            self.act = nn.ReLU()

        def forward(self, x):
            return self.down(self.act(self.gate(x)) * self.up(x))

    class Inline(nn.Module):
        def __init__(self, d=16, h=40):
            super().__init__()
            self.w_up = nn.Parameter(torch.randn(h, d) / d**0.5)
            self.w_down = nn.Parameter(torch.randn(d, h) / h**0.5)

        def forward(self, x):
            return x + torch.relu(x @ self.w_up.T) @ self.w_down.T

    def build():
        torch.manual_seed(0)
        return nn.Sequential(MLP(), Inline())
    """
)

# An ordinary training step; argv: mode ("bare": torch.compile(model), "inductor":
# backend="inductor", "none": never compiles), output path.
TRAIN_SCRIPT = MODEL_SRC + textwrap.dedent(
    """
    import sys

    mode, out_path = sys.argv[1], sys.argv[2]
    model = build()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    if mode == "bare":
        fn = torch.compile(model)
    elif mode == "inductor":
        fn = torch.compile(model, backend="inductor")
    else:
        fn = model
    out = fn(x)
    out.square().mean().backward()
    torch.save({"state": state, "x": x, "out": out.detach(),
                "grads": {n: p.grad for n, p in model.named_parameters()}}, out_path)
    """
)

RUNNER = textwrap.dedent(
    """
    import runpy, sys
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
    print("ACTIVATE_IMPORTED", "twell_compile.activate" in sys.modules)
    import twell_compile
    print("REWRITTEN", len(twell_compile.report().rewritten))
    """
)


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWELL")}
    env.update(extra)
    return env


def run_python(args: list[str], env: dict, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def parse(stdout: str) -> dict:
    values = {}
    for line in stdout.splitlines():
        key, _, value = line.partition(" ")
        if key in ("ACTIVATE_IMPORTED", "REWRITTEN"):
            values[key] = value.strip()
    return values


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, out_path: Path):
        self.proc = proc
        assert proc.returncode == 0, f"script failed (rc={proc.returncode}):\n{proc.stderr[-5000:]}"
        self.info = parse(proc.stdout)
        self.data = torch.load(out_path)

    @property
    def rewritten(self) -> int:
        return int(self.info["REWRITTEN"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The training script under: no TWELL; TWELL=1 with bare torch.compile; TWELL=1 with
    backend="inductor"; TWELL=1 without compiling. TWELL_L1=0.5 wherever TWELL=1.

    The four runs go in parallel. Inductor gets a cache directory of its own, fresh for this
    module, so no artefact of an earlier run (or of the user) can be served.
    """
    tmp = tmp_path_factory.mktemp("twell_env")
    script = tmp / "train.py"
    script.write_text(TRAIN_SCRIPT)
    runner = tmp / "runner.py"
    runner.write_text(RUNNER)
    common = {"TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor_cache")}
    cases = {
        "unset-bare": ("bare", clean_env(**common)),
        "twell-bare": ("bare", clean_env(TWELL="1", TWELL_L1="0.5", **common)),
        "twell-inductor": ("inductor", clean_env(TWELL="1", TWELL_L1="0.5", **common)),
        "twell-none": ("none", clean_env(TWELL="1", TWELL_L1="0.5", **common)),
    }
    procs = {}
    for name, (mode, env) in cases.items():
        out = tmp / f"{name}.pt"
        cmd = [sys.executable, str(runner), str(script), mode, str(out)]
        procs[name] = (cmd, subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out)
    results = {}
    for name, (cmd, popen, out) in procs.items():
        stdout, stderr = popen.communicate(timeout=600)
        results[name] = (subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr), out)
    return results


def get_run(runs, name) -> Run:
    proc, out = runs[name]
    return Run(proc, out)


def _hidden(m, x):
    if hasattr(m, "gate"):  # MLP
        return torch.relu(m.gate(x)) * m.up(x)
    return torch.relu(x @ m.w_up.T)  # Inline


def eager_reference(data, l1_coeff: float = 0.0):
    """The script's model rebuilt here, eager: output and gradients of ``loss + c · L1``, the L1
    term the mean over the model's two FFNs (the patched MLP and the compiled inline one)."""
    namespace: dict = {}
    exec(MODEL_SRC, namespace)  # noqa: S102 - our own source string
    model = namespace["build"]()
    model.load_state_dict(data["state"])
    loss = eager_loss(
        model,
        lambda: model(data["x"]),
        lambda out: out.square().mean(),
        l1_coeff,
        modules=[model[0], model[1]],
        hidden_fn=_hidden,
    )
    loss.backward()
    return model(data["x"]).detach(), {n: p.grad for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# (a) unmodified compile scripts
# ---------------------------------------------------------------------------------------------


def test_unset_twell_leaves_compile_untouched(runs):
    run = get_run(runs, "unset-bare")
    assert run.info["ACTIVATE_IMPORTED"] == "False"
    assert run.rewritten == 0
    out, grads = eager_reference(run.data)
    assert_close(run.data["out"], out, rtol=1e-5, atol=1e-6, name="out")


@pytest.mark.parametrize("name", ["twell-bare", "twell-inductor"])
def test_twell_1_rewrites_both_ffns_of_a_compiled_script(runs, name):
    run = get_run(runs, name)
    assert run.info["ACTIVATE_IMPORTED"] == "True"
    assert run.rewritten == 2, run.proc.stdout  # the MLP module (patched) and the inline FFN
    out, _ = eager_reference(run.data)
    assert_close(run.data["out"], out, rtol=1e-5, atol=1e-6, name="out")


@pytest.mark.parametrize("name", ["twell-inductor", "twell-bare"])
def test_twell_l1_is_the_mean_over_the_models_ffns(runs, name):
    """TWELL_L1=0.5: the gradients are those of ``loss + 0.5 · mean(L1_mlp, L1_inline)``, though the
    eager patch rewrote one FFN and a compile route (Inductor's pre-grad pass, or the default
    backend on torch >= 2.13) the other, in a graph of its own."""
    run = get_run(runs, name)
    _, grads = eager_reference(run.data, l1_coeff=0.5)
    for param, want in grads.items():
        assert_close(run.data["grads"][param], want, rtol=1e-4, atol=1e-5 * (1 + float(want.abs().max())), name=param)


# ---------------------------------------------------------------------------------------------
# (b) scripts that never compile: the eager patch
# ---------------------------------------------------------------------------------------------


def test_twell_1_patches_a_script_that_never_compiles(runs):
    patched = get_run(runs, "twell-none")
    assert patched.info["ACTIVATE_IMPORTED"] == "True"
    assert patched.rewritten == 1  # the MLP module; the inline FFN needs a compile
    out, _ = eager_reference(patched.data)
    assert_close(patched.data["out"], out, rtol=1e-5, atol=1e-6, name="out")


NO_RELU_SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    class SwiGLU(nn.Module):  # an FFN-shaped module the matcher must not rewrite
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(16, 40), nn.Linear(16, 40), nn.Linear(40, 16)

        def forward(self, x):
            return self.down(F.silu(self.gate(x)) * self.up(x))

    model = nn.Sequential(SwiGLU(), SwiGLU())
    x = torch.randn(4, 16)
    with torch.no_grad():
        model(x)
        import twell_compile
        after_first = twell_compile.report().graphs
        for _ in range(5):
            model(x)
        print("PATCH_RUNS", after_first, twell_compile.report().graphs)
    """
)


def test_twell_1_eager_patch_is_one_shot_without_relu_ffns(tmp_path):
    """With no ReLU FFN to rewrite, the global pre-hook must not re-run ``patch`` (and re-trace
    every candidate module) on every module call of every step."""
    proc = run_python(["-c", NO_RELU_SCRIPT], clean_env(TWELL="1"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("PATCH_RUNS"))
    after_first, after_six = map(int, line.split()[1:])
    assert after_six == after_first, f"patch() ran {after_first} times in the first forward, {after_six} after six"


# ---------------------------------------------------------------------------------------------
# (c) invalid TWELL_* values stop the run, naming the variable; (d) import torch stays clean
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("var,value", [("TWELL_L1", "abc"), ("TWELL_L1", "-1"), ("TWELL_L1", "1e39"), ("TWELL_STRICT", "maybe"),
                                       ("TWELL_INNER", "foo"), ("TWELL_QUIET", "loud"), ("TWELL_RELU_GATE", "2"),
                                       ("TWELL", "flase"), ("TWELL", "garbage")])
def test_invalid_env_value_exits_naming_the_variable(var, value, tmp_path):
    """One line on stderr naming the variable, exit status 2, no traceback; nothing runs after
    ``import torch`` (a typo in TWELL must not switch twell on, nor train without it silently)."""
    env = clean_env(**{"TWELL": "1", var: value})
    proc = run_python(["-c", "import torch; print('IMPORTED')"], env, tmp_path)
    assert proc.returncode == 2
    assert "IMPORTED" not in proc.stdout
    assert var in proc.stderr and value in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


FFN_FIRST_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(16, 40), nn.Linear(16, 40), nn.Linear(40, 16)

        def forward(self, x):
            return self.down(torch.relu(self.gate(x)) * self.up(x))

    torch.manual_seed(0)
    model = MLP()  # the FFN is the model: it is the first module called
    x = torch.randn(4, 16)
    out = model(x)
    out.square().mean().backward()
    torch.save({"state": {k: v for k, v in model.state_dict().items()}, "x": x, "out": out.detach(),
                "grads": {n: p.grad for n, p in model.named_parameters()}}, sys.argv[1])
    """
)


def test_twell_1_patches_an_ffn_that_is_the_first_module_called(tmp_path):
    """Step 0 runs patched too: its gradients carry the L1 term."""
    script = tmp_path / "ffn_first.py"
    script.write_text(FFN_FIRST_SCRIPT)
    out = tmp_path / "ffn_first.pt"
    proc = run_python([str(script), str(out)], clean_env(TWELL="1", TWELL_L1="0.5"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = torch.load(out)
    model = GatedFFN(16, 40)
    model.load_state_dict(data["state"])
    eager_loss(model, lambda: model(data["x"]), lambda o: o.square().mean(), 0.5).backward()
    for name, p in model.named_parameters():
        assert_close(data["grads"][name], p.grad, rtol=1e-4, atol=1e-5 * (1 + float(p.grad.abs().max())), name=name)


CHECK_MODULES = textwrap.dedent(
    """
    import sys
    import torch
    loaded = sorted(m for m in sys.modules if m.startswith(("twell_compile", "torch._inductor")))
    print("LOADED", ",".join(loaded))
    """
)


def _loaded(env, tmp_path) -> set[str]:
    proc = run_python(["-c", CHECK_MODULES], env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("LOADED"))
    return set(filter(None, line.split(" ", 1)[1].split(",")))


def test_import_torch_without_twell_imports_nothing_of_ours(tmp_path):
    loaded = _loaded(clean_env(), tmp_path)
    assert loaded <= {"twell_compile", "twell_compile.autoload"}, loaded


def test_import_torch_with_twell_stays_light(tmp_path):
    """The hook installs its routes lazily: no lowering, no Inductor at ``import torch``."""
    loaded = _loaded(clean_env(TWELL="1"), tmp_path)
    assert "twell_compile.activate" in loaded
    assert not {m for m in loaded if m.startswith(("twell_compile.lowering", "twell_compile.kernels", "torch._inductor"))}, loaded


# ---------------------------------------------------------------------------------------------
# (e) twell_compile.patch in process
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fresh():
    reset_state()
    yield
    reset_state()


def test_patch_outputs_report_and_training_grads(fresh):
    torch.manual_seed(0)
    model = ResidualStack(16, 40, n=3, kinds=("gated", "plain"))
    ref = copy.deepcopy(model)
    result = twell_compile.patch(model, l1_coeff=0.25)
    assert [(r.where, r.kind) for r in result.rewritten] == [("layers.0", "gated"), ("layers.1", "plain"), ("layers.2", "gated")]
    assert not result.skipped
    report = twell_compile.report()
    assert [r.where for r in report.rewritten] == ["layers.0", "layers.1", "layers.2"]
    assert "layers.1" in str(result)

    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6, name="inference")
    out = model(x)
    assert_close(out, ref(x), rtol=1e-5, atol=1e-6, name="training forward")
    out.square().mean().backward()
    eager_loss(ref, lambda: ref(x), lambda o: o.square().mean(), 0.25).backward()  # mean over the 3 layers
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)

    stats = twell_compile.stats()
    assert [s.where for s in stats.layers] == ["layers.0", "layers.1", "layers.2"]
    assert all(s.calls == 2 and s.tokens == 10 for s in stats.layers)


def test_patch_then_set_l1_coeff(fresh):
    torch.manual_seed(0)
    model = nn.Sequential(GatedFFN(16, 40))
    ref = copy.deepcopy(model)
    twell_compile.patch(model, l1_coeff=0.0)
    twell_compile.set_l1_coeff(0.5)
    x = torch.randn(6, 16)
    model(x).sum().backward()
    eager_loss(ref, lambda: ref(x), lambda o: o.sum(), 0.5).backward()
    twell_compile.set_l1_coeff(0.0)
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)


def test_patch_is_idempotent_and_skips_near_misses(fresh):
    class NearMiss(nn.Module):  # h is also returned: not a whole-module FFN
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(16, 40)
            self.down = nn.Linear(40, 16)

        def forward(self, x):
            h = torch.relu(self.up(x))
            return self.down(h), h

    torch.manual_seed(0)
    model = nn.ModuleDict({"ffn": PlainFFN(16, 40), "near": NearMiss()})
    first = twell_compile.patch(model)
    assert [r.where for r in first.rewritten] == ["ffn"]
    assert [s.reason for s in first.skipped] == [SkipReason.MULTI_USER]
    second = twell_compile.patch(model)
    assert second.rewritten == []
    with pytest.raises(TwellRewriteError, match="an intermediate value has another user"):
        twell_compile.patch(nn.ModuleDict({"near": NearMiss()}), strict=True)


def test_patch_rejects_unknown_options(fresh):
    with pytest.raises(ValueError, match="l1"):
        twell_compile.patch(PlainFFN(16, 40), l1=0.1)


def test_patched_model_under_autocast(fresh):
    """``torch.autocast`` around a patched model: the op gets bf16 inputs while autocast is live."""
    torch.manual_seed(0)
    model = GatedFFN(16, 40)  # H=40 < 128 columns, ~50% active: overflowed tiles, dense rows
    ref = copy.deepcopy(model)
    twell_compile.patch(model)
    x = torch.randn(6, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = model(x), ref(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert_close(got, want, rtol=2e-2, atol=2e-2, name="autocast")
