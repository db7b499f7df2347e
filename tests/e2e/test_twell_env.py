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


def test_twell_1_says_what_each_route_rewrote(runs):
    """One stderr line per model and route: the patched MLP module, then the inline FFN that
    Inductor's pre-grad pass rewrote; nothing without TWELL."""
    def lines(name):
        return [ln for ln in runs[name][0].stderr.splitlines() if ln.startswith("twell:")]

    assert lines("unset-bare") == []
    patched, compiled = lines("twell-inductor")
    assert patched.startswith("twell: rewrote 1 FFN(s) of Sequential (0), skipped 0; l1_coeff 0.5 "), patched
    assert compiled.startswith("twell: rewrote 1 FFN(s) of Sequential (1) in compiled graphs, "), compiled


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


NOTHING_MATCHED_SCRIPT = textwrap.dedent(
    """
    import torch, transformers
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    silu = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_act="silu", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=64, max_position_embeddings=16))
    silu(input_ids=ids, labels=ids).loss.backward()
    # GPT-2's ReLU FFNs: Conv1D projections, which no route rewrites
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16, activation_function="relu"))
    gpt2(input_ids=ids, labels=ids).loss.backward()
    print("DONE")
    """
)


def test_twell_1_warns_when_nothing_matched_and_twell_quiet_silences_it(tmp_path):
    procs = {quiet: subprocess.Popen([sys.executable, "-c", NOTHING_MATCHED_SCRIPT], cwd=tmp_path, text=True,
                                     env=clean_env(TWELL="1", **({"TWELL_QUIET": "1"} if quiet else {})),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for quiet in (False, True)}
    out = {quiet: p.communicate(timeout=300) for quiet, p in procs.items()}
    for quiet, p in procs.items():
        assert p.returncode == 0 and "DONE" in out[quiet][0], out[quiet][1][-3000:]
    loud = out[False][1]
    assert "no FFN of LlamaForCausalLM has been rewritten" in loud and "TWELL_RELU_GATE=1" in loud, loud[-3000:]
    assert "TWELL=1 rewrote no FFN of GPT2LMHeadModel" in loud, loud[-3000:]
    assert "twell" not in out[True][1].lower(), out[True][1][-3000:]


# ---------------------------------------------------------------------------------------------
# (c) invalid TWELL_* values stop the run, naming the variable; (d) import torch stays clean
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("var,value", [("TWELL_L1", "abc"), ("TWELL_L1", "-1"), ("TWELL_L1", "1e39"), ("TWELL_STRICT", "maybe"),
                                       ("TWELL_INNER", "foo"), ("TWELL_QUIET", "loud"), ("TWELL_RELU_GATE", "2"),
                                       ("TWELL", "flase"), ("TWELL", "garbage"), ("TWELL_PLAIN_LAUNCH", "2")])
def test_invalid_env_value_exits_naming_the_variable(var, value, tmp_path):
    """One line on stderr naming the variable, exit status 2, no traceback; nothing runs after
    ``import torch`` (a typo in TWELL must not switch twell on, nor train without it silently)."""
    env = clean_env(**{"TWELL": "1", var: value})
    proc = run_python(["-c", "import torch; print('IMPORTED')"], env, tmp_path)
    assert proc.returncode == 2
    assert "IMPORTED" not in proc.stdout
    assert var in proc.stderr and value in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_unknown_twell_variable_exits_naming_the_accepted_ones(tmp_path):
    """A misspelt name (``TWELL_L1_COEF``) would leave its setting silently unapplied."""
    proc = run_python(["-c", "import torch; print('IMPORTED')"], clean_env(TWELL="1", TWELL_L1_COEF="1e-3"), tmp_path)
    assert proc.returncode == 2 and "IMPORTED" not in proc.stdout
    assert proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "TWELL_L1_COEF is not a twell variable" in proc.stderr and "TWELL_L1, " in proc.stderr, proc.stderr


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


# ---------------------------------------------------------------------------------------------
# (f) TWELL=1's first-call hook and compile wrapper, in process
# ---------------------------------------------------------------------------------------------

IN_PROCESS_L1 = 0.25


@pytest.fixture
def twell_1(monkeypatch):
    """TWELL=1 in this process, ``TWELL_L1=0.25``: its first-call hook and its ``torch.compile``
    wrapper, both removed afterwards; not its Inductor routes, which would outlive the test."""
    from twell_compile import activate, announcement
    from twell_compile.options import TwellOptions

    reset_state()
    monkeypatch.delenv("TWELL_QUIET", raising=False)
    options = TwellOptions(l1_coeff=IN_PROCESS_L1)
    monkeypatch.setattr(activate, "_options", options)
    monkeypatch.setattr(announcement, "_options", options)
    monkeypatch.setattr(announcement, "_announced", set())
    monkeypatch.setattr(activate, "_roots_without_ffn", 0)
    monkeypatch.setattr(activate, "install_compile_routes", lambda: None)
    monkeypatch.setattr(torch, "compile", activate._compile_wrapper(torch.compile))
    monkeypatch.setattr(activate, "_hook_handle",
                        torch.nn.modules.module.register_module_forward_pre_hook(activate._patch_on_first_call))
    yield IN_PROCESS_L1
    activate._remove_hook()
    reset_state()


def _summary_lines(capfd) -> list[str]:
    return [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("twell:")]


def test_blocks_compiled_one_by_one_share_the_models_l1_mean(twell_1, capfd):
    """``torch.compile`` on each block, as regional compilation does: each block's FFN is
    registered on its first call under the model calling it, so the L1 term is the mean over the
    model's three layers (not their sum), and the layers carry their full names."""
    torch.manual_seed(0)
    model = ResidualStack(16, 40, n=3, kinds=("gated", "plain"))
    ref = copy.deepcopy(model)
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend="aot_eager")
    x = torch.randn(2, 5, 16)
    model(x).square().mean().backward()
    eager_loss(ref, lambda: ref(x), lambda o: o.square().mean(), twell_1).backward()
    for i, block in enumerate(model.layers):
        assert_grads_close(block._orig_mod, ref.layers[i], rtol=1e-4, atol_frac=1e-5, prefix=f"layers.{i}.")
    assert [r.where for r in twell_compile.report().rewritten] == ["layers.0", "layers.1", "layers.2"]
    assert [s.where for s in twell_compile.stats(model).layers] == ["layers.0", "layers.1", "layers.2"]
    (line,) = _summary_lines(capfd)
    assert line.startswith("twell: rewrote 3 FFN(s) of ResidualStack (layers.*), skipped 0; l1_coeff 0.25 "), line


def test_a_frozen_teacher_called_first_leaves_the_hook_for_the_student(twell_1, capfd):
    """The first model called runs without grad (a teacher): it is patched, and so is the student
    called next, which trains with the L1 term."""
    from twell_compile import activate

    torch.manual_seed(0)
    student = ResidualStack(16, 40, n=2)
    teacher = copy.deepcopy(student).eval()
    ref = copy.deepcopy(student)
    x = torch.randn(4, 16)
    with torch.no_grad():
        target = teacher(x)
    assert activate._hook_handle is not None
    (student(x) - target).square().mean().backward()
    assert activate._hook_handle is None  # the model that trains is patched
    eager_loss(ref, lambda: ref(x), lambda o: (o - target).square().mean(), twell_1).backward()
    assert_grads_close(student, ref, rtol=1e-4, atol_frac=1e-5)
    assert len(twell_compile.stats(student).layers) == 2 and len(twell_compile.stats(teacher).layers) == 2
    first, second = _summary_lines(capfd)
    assert "of ResidualStack" in first and "eval mode or without grad" in first, first
    assert "of ResidualStack" in second and "eval mode" not in second, second


def test_an_ffn_called_first_with_a_keyword_argument_runs_patched_and_hooks_fire_once(twell_1):
    torch.manual_seed(0)
    model = GatedFFN(16, 40)
    ref = copy.deepcopy(model)
    before, after = [], []
    model.register_forward_pre_hook(lambda mod, args, kwargs: before.append(kwargs), with_kwargs=True)
    model.register_forward_hook(lambda mod, args, out: after.append(out.detach()))
    x = torch.randn(4, 16)
    out = model(x=x)
    out.square().mean().backward()
    eager_loss(ref, lambda: ref(x), lambda o: o.square().mean(), twell_1).backward()
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)
    assert len(before) == 1 and len(after) == 1
    assert_close(after[0], out.detach(), rtol=0, atol=0, name="what the forward hook saw")


class InlineWithLinears(nn.Module):
    """Two ``nn.Linear`` children (a candidate for the patch) around an FFN written inline, which
    only a compile route can rewrite."""

    def __init__(self, d=16, h=40):
        super().__init__()
        self.emb = nn.Linear(d, d)
        self.head = nn.Linear(d, d)
        self.w_up = nn.Parameter(torch.randn(h, d) / d**0.5)
        self.w_down = nn.Parameter(torch.randn(d, h) / h**0.5)

    def forward(self, x):
        x = self.emb(x)
        return self.head(x + torch.relu(x @ self.w_up.T) @ self.w_down.T)


class Conv1D(nn.Module):
    """HF GPT-2's projection: ``x @ W + b`` with W of shape [in, out]."""

    def __init__(self, nx, nf):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx**0.5)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)


class Gpt2Mlp(nn.Module):
    def __init__(self, d=16, h=40):
        super().__init__()
        self.c_fc = Conv1D(d, h)
        self.c_proj = Conv1D(h, d)

    def forward(self, x):
        return self.c_proj(torch.relu(self.c_fc(x)))


def _twell_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "twell" in str(w.message)]


def test_compiled_models_warn_only_when_no_route_rewrote_anything(twell_1):
    import warnings

    x = torch.randn(4, 16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        # patch() cannot replace the inline FFN, but the compiled graph has it rewritten
        torch.compile(InlineWithLinears(), backend="twell", options={"inner": "aot_eager"})(x)
        assert [r.graph != "patch" for r in twell_compile.report().rewritten] == [True]
        # a model patched at its first call, then compiled, and a wrapper around it compiled
        model = ResidualStack(16, 40, n=2)
        model(x)
        torch.compile(model, backend="aot_eager")(x)
        torch.compile(nn.Sequential(model), backend="aot_eager")(x)
        assert _twell_warnings(record) == []
        # nothing to rewrite (GPT-2's Conv1D projections): said after the first call, not before
        compiled = torch.compile(nn.Sequential(Gpt2Mlp(), Gpt2Mlp()), backend="aot_eager")
        assert _twell_warnings(record) == []
        compiled(x)
    (message,) = _twell_warnings(record)
    assert message.startswith("twell: TWELL=1 rewrote no FFN of Sequential: "), message


def test_a_model_of_conv1d_ffns_is_said_to_have_none_rewritten(twell_1):
    with pytest.warns(RuntimeWarning, match="TWELL=1 rewrote no FFN of Sequential: none of its modules is a ReLU FFN"):
        nn.Sequential(Gpt2Mlp(), Gpt2Mlp())(torch.randn(4, 16))


def test_a_framework_that_compiles_a_method_itself_gets_the_layers_before_tracing(twell_1):
    """Lightning's ``torch.compile(lightning_module)`` keeps only the compile context and applies it
    to ``training_step``: the layers are registered when Dynamo starts, so tracing never stops
    to register them (one graph, no break) and the L1 term is the mean over the model's layers."""
    from torch._dynamo.utils import counters

    class Lit(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = ResidualStack(16, 40, n=3, kinds=("gated", "plain"))

        def training_step(self, x):
            return self.model(x).square().mean()

    torch.manual_seed(0)
    lit = Lit()
    ref = copy.deepcopy(lit.model)
    step = torch.compile(lit, backend="aot_eager").dynamo_ctx(lit.training_step)
    counters.clear()
    x = torch.randn(4, 16)
    step(x).backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    eager_loss(ref, lambda: ref(x), lambda o: o.square().mean(), twell_1).backward()
    assert_grads_close(lit.model, ref, rtol=1e-4, atol_frac=1e-5)
