"""Options of the twell backend, validated in one place for ``options={...}`` and ``TWELL_*``."""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
# torch.compile's modes (Inductor's: torch._inductor.list_mode_options)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class TwellOptions:
    """What the backend does with the FFNs it finds.

    Args:
        l1_coeff: coefficient of the L1 penalty on the hidden activations (float ≥ 0). The
            backward adds ``l1_coeff · ∂L1/∂θ`` (docs/architecture.md, 'The L1 regularizer'); 0 turns it off exactly.
            Change it later without recompiling through ``twell_compile.set_l1_coeff``.
        inner: compiler for the rewritten graph. Values: ``"inductor"`` (default),
            ``"aot_eager"`` (AOTAutograd, no code generation), ``"eager"`` (rewrite only).
        strict: raise ``TwellRewriteError`` instead of leaving an FFN-like pattern unrewritten.
        mode: the inner Inductor's compile mode, e.g. ``"reduce-overhead"`` (CUDA graphs).
            ``torch.compile`` takes ``mode`` or ``options`` but not both, so with other options
            pass it here: ``options={"mode": "reduce-overhead", "l1_coeff": 1e-5}``.
        target_density: steer each layer's L1 coefficient, from ``l1_coeff``, so that the share of
            active hidden units approaches this value (for example 0.005) while the model trains
            (``density_control.py``); None (default): the coefficient stays ``l1_coeff``.
        l1_coeff_max: the largest coefficient ``target_density`` may reach (default
            ``1000 · max(l1_coeff, 2e-5)``): it bounds the weight of the L1 term, not the
            language-model loss itself.
        relu_gate: rewrite SiLU- and GELU-gated FFNs (standard Llama, Mistral, Qwen, Gemma
            configurations) as ReLU-gated TwELL FFNs with the L1 term: the paper's recipe for a
            model trained from scratch. It changes the model's function, so it is off by default,
            and such FFNs are then reported as skipped, naming this option.
        dense_variant: on a GPU, also compile each graph with its FFNs as the model wrote them
            (Inductor's code, with the L1 term), run while that is measured to be faster, as it is
            while the layers are dense (``variants.py``). Twice the compile time; False: only
            the TwELL ops.
    """

    l1_coeff: float = 2e-5
    inner: str = "inductor"
    strict: bool = False
    mode: Optional[str] = None
    target_density: Optional[float] = None
    l1_coeff_max: Optional[float] = None
    relu_gate: bool = False
    dense_variant: bool = True

    def __post_init__(self) -> None:
        check_l1(self.l1_coeff, "options['l1_coeff']")
        if self.inner not in INNER_COMPILERS:
            raise ValueError(f"twell: options['inner'] = {self.inner!r} is not accepted; use one of {', '.join(INNER_COMPILERS)}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"twell: options['strict'] = {self.strict!r} is not accepted; use True or False")
        if self.target_density is not None:
            t = self.target_density
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t < 1.0:
                raise ValueError(f"twell: options['target_density'] = {t!r} is not accepted; expected a fraction in (0, 1), "
                                 "e.g. 0.005 for 0.5% of the hidden units active")
        if self.l1_coeff_max is not None:
            check_l1(self.l1_coeff_max, "options['l1_coeff_max']")
            if self.l1_coeff_max < self.l1_coeff:
                raise ValueError(f"twell: options['l1_coeff_max'] = {self.l1_coeff_max!r} is below l1_coeff = {self.l1_coeff!r}")
        if not isinstance(self.dense_variant, bool):
            raise ValueError(f"twell: options['dense_variant'] = {self.dense_variant!r} is not accepted; use True or False")
        if not isinstance(self.relu_gate, bool):
            raise ValueError(f"twell: options['relu_gate'] = {self.relu_gate!r} is not accepted; use True or False")
        if self.mode is not None and self.mode not in COMPILE_MODES:
            raise ValueError(f"twell: options['mode'] = {self.mode!r} is not accepted; use one of {', '.join(COMPILE_MODES)}")

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> "TwellOptions":
        """Options from ``torch.compile(..., options={...})``; unknown keys are errors."""
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"twell: options must be a dict such as {{'l1_coeff': 2e-5}}, got {type(options).__name__} "
                             f"{options!r}")
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"twell: unknown option {unknown[0]!r}; accepted options: {', '.join(sorted(known))}")
        return cls(**options)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "TwellOptions":
        """Options from ``TWELL_L1``, ``TWELL_INNER``, ``TWELL_STRICT``, ``TWELL_TARGET_DENSITY``,
        ``TWELL_L1_MAX`` and ``TWELL_RELU_GATE`` (unset: default); a bad value raises naming the variable."""
        env = os.environ if environ is None else environ
        kwargs: dict[str, Any] = {}
        if "TWELL_L1" in env:
            raw = env["TWELL_L1"]
            try:
                kwargs["l1_coeff"] = float(raw)
            except ValueError:
                raise ValueError(f"twell: TWELL_L1={raw!r} is not a number; expected a float >= 0, e.g. TWELL_L1=2e-5") from None
            try:
                check_l1(kwargs["l1_coeff"], "TWELL_L1")
            except ValueError:
                raise ValueError(f"twell: TWELL_L1={raw!r} is not accepted; expected a float >= 0 that is finite in "
                                 "float32, e.g. TWELL_L1=2e-5") from None
        if "TWELL_INNER" in env:
            inner = env["TWELL_INNER"].strip().lower()
            if inner not in INNER_COMPILERS:
                raise ValueError(f"twell: TWELL_INNER={env['TWELL_INNER']!r} is not accepted; use one of {', '.join(INNER_COMPILERS)}")
            kwargs["inner"] = inner
        if "TWELL_STRICT" in env:
            kwargs["strict"] = env_flag("TWELL_STRICT", env)
        for var, key in (("TWELL_TARGET_DENSITY", "target_density"), ("TWELL_L1_MAX", "l1_coeff_max")):
            if var in env:
                try:
                    kwargs[key] = float(env[var])
                except ValueError:
                    raise ValueError(f"twell: {var}={env[var]!r} is not a number") from None
        if "TWELL_DENSE_VARIANT" in env:
            kwargs["dense_variant"] = env_flag("TWELL_DENSE_VARIANT", env)
        if "TWELL_RELU_GATE" in env:
            kwargs["relu_gate"] = env_flag("TWELL_RELU_GATE", env)
        try:
            return cls(**kwargs)
        except ValueError as exc:
            names = {"target_density": "TWELL_TARGET_DENSITY", "l1_coeff_max": "TWELL_L1_MAX"}
            message = str(exc)
            for key, var in names.items():
                message = message.replace(f"options['{key}'] = ", f"{var}=")
            raise ValueError(message) from None


# Every TWELL_* variable read anywhere: TWELL, the options' (``TwellOptions.from_env``),
# TWELL_QUIET (activate.py), TWELL_PLAIN_LAUNCH (kernels/launch.py) and TWELL_CALL_REPLAY
# (lowering/call_replay.py).
ENV_VARIABLES = ("TWELL", "TWELL_L1", "TWELL_INNER", "TWELL_STRICT", "TWELL_TARGET_DENSITY", "TWELL_L1_MAX",
                 "TWELL_DENSE_VARIANT", "TWELL_RELU_GATE", "TWELL_QUIET", "TWELL_PLAIN_LAUNCH", "TWELL_CALL_REPLAY")
# The switches their modules read when they load, mid-run: 0 or 1, checked up front.
LOAD_TIME_SWITCHES = ("TWELL_PLAIN_LAUNCH", "TWELL_CALL_REPLAY")


def check_env(environ: Mapping[str, str] | None = None) -> None:
    """The ``TWELL_*`` variables the options do not hold; a bad one raises naming it.

    A name nothing reads (a typo such as ``TWELL_L1_COEF``) would leave its setting silently
    unapplied. ``TWELL_PLAIN_LAUNCH`` and ``TWELL_CALL_REPLAY`` are read by their modules only
    when those load, mid-run: checked here, they stop the run before any work.
    """
    env = os.environ if environ is None else environ
    unknown = sorted(k for k in env if k.startswith("TWELL_") and k not in ENV_VARIABLES)
    if unknown:
        raise ValueError(f"twell: {unknown[0]} is not a twell variable; the accepted ones are {', '.join(ENV_VARIABLES)}")
    if "TWELL_QUIET" in env:
        env_flag("TWELL_QUIET", env)
    for name in LOAD_TIME_SWITCHES:
        if env.get(name, "0") not in ("0", "1"):  # their modules' own test, exactly
            raise ValueError(f"twell: {name}={env[name]!r} is not accepted; use 0 or 1")


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A boolean environment variable; anything but a clear yes/no is an error naming it."""
    env = os.environ if environ is None else environ
    raw = env.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"twell: {name}={raw!r} is not accepted; use 1/0 (or true/false, on/off, yes/no)")


def quiet() -> bool:
    """``TWELL_QUIET=1`` silences ``TWELL=1``'s one-line summaries and its nothing-matched warnings."""
    try:
        return env_flag("TWELL_QUIET")
    except ValueError:
        return False  # checked at activation, which stops the run on a bad value


def check_l1(value: Any, where: str) -> None:
    """A coefficient is a number >= 0 that stays finite in float32, the dtype the ops read it in
    (1e39 is a finite Python float but Inf in float32)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or not _finite_in_float32(value):
        raise ValueError(f"twell: {where} = {value!r} is not accepted; expected a float >= 0 that is finite in "
                         "float32 (at most 3.4e38; default 2e-5)")


def _finite_in_float32(value: float) -> bool:
    try:
        return math.isfinite(struct.unpack("f", struct.pack("f", value))[0])  # float32's rounding
    except OverflowError:
        return False
