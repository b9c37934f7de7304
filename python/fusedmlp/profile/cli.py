"""Linear -> MLP profiling study: eager vs torch.compile vs fused, side by side.

    python -m fusedmlp.profile [--device cuda] [--experiments linear,mlp,gated] [--out DIR]

Each experiment runs as eager PyTorch, torch.compile of it, our fused modules and torch.compile
of those (and, for the gated block on CUDA, Liger's GEGLU MLP when liger_kernel imports), all
sharing one set of weights. For each variant it writes a Chrome/Perfetto trace and reports ops
and kernels per forward, the operator tree of a forward, CPU, GPU and wall time per forward,
memory above the inputs and weights (peak of an inference forward, saved for backward), and
whether the output matches eager; then summary.json, summary.md, a chart and one timeline
picture per experiment (every variant's forward on one time axis).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fusedmlp.profile.chart import write_chart
from fusedmlp.profile.experiments import (
    ALL_VARIANTS,
    COMPILE,
    EXPERIMENTS,
    FUSED,
    FUSED_COMPILE,
    MLP_ACTIVATIONS,
    UNCOMPILED_VARIANTS,
    Experiment,
    build_experiment,
    default_tokens,
    variant_model,
)
from fusedmlp.profile.measure import (
    ExperimentResult,
    Model,
    VariantResult,
    WallTime,
    check_output,
    profile_forward,
    time_forwards,
    warm_up,
)
from fusedmlp.profile.reading import format_ms
from fusedmlp.profile.report import (
    environment,
    summary_markdown,
    timeline_file,
    write_summary_json,
)
from fusedmlp.profile.timeline import write_timeline
from fusedmlp.registry import cpu_bf16_native
from fusedmlp.tools.memory import (
    ForwardMemory,
    measure_call,
    saved_for_backward,
    torch_sees_whole_peak,
)
from fusedmlp.tools.plotting import require_matplotlib
from fusedmlp.tools.quiet_profiler import quiet_kineto

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
DEFAULT_ITERS = {"cuda": 50, "cpu": 10}
CHART_FILE, SUMMARY_MD, SUMMARY_JSON = "summary.png", "summary.md", "summary.json"


@dataclass(frozen=True)
class StudySettings:
    device: torch.device
    dtype: torch.dtype
    experiments: list[str]
    tokens: int | None
    iters: int
    warmup: int
    profile_steps: int
    compile: bool
    mlp_activation: str
    out: Path

    @property
    def variants(self) -> tuple[str, ...]:
        return ALL_VARIANTS if self.compile else UNCOMPILED_VARIANTS

    def as_json(self) -> dict[str, object]:
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "experiments": self.experiments,
            "tokens": self.tokens,
            "iters": self.iters,
            "warmup": self.warmup,
            "profile_steps": self.profile_steps,
            "variants": list(self.variants),
            "mlp_activation": self.mlp_activation,
        }


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def experiment_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in EXPERIMENTS:
            raise argparse.ArgumentTypeError(
                f"unknown experiment {name!r} (choose from {', '.join(EXPERIMENTS)})"
            )
    if not names:
        raise argparse.ArgumentTypeError("no experiment given")
    return list(dict.fromkeys(names))


def dtype_name(text: str) -> torch.dtype:
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r} (choose from {', '.join(DTYPES)})"
        )
    return DTYPES[text]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fusedmlp.profile",
        description="Profile Linear, MLP and GeGLU blocks: eager vs torch.compile vs fused.",
    )
    parser.add_argument("--device", help="cpu or cuda (default: cuda if available, else cpu)")
    parser.add_argument(
        "--dtype",
        type=dtype_name,
        help="float32, bfloat16 or float16 (default: bfloat16 on CUDA and on a CPU whose "
        "bfloat16 kernels multiply bfloat16 in hardware, else float32)",
    )
    parser.add_argument(
        "--experiments",
        type=experiment_list,
        default=list(EXPERIMENTS),
        help="comma-separated subset of linear,mlp,gated (default: all)",
    )
    parser.add_argument("--tokens", type=positive_int, help="input rows for every experiment")
    parser.add_argument(
        "--iters",
        type=positive_int,
        help="timed forwards per variant (default: 50 on CUDA, 10 on CPU)",
    )
    parser.add_argument(
        "--warmup", type=positive_int, default=3, help="forwards before measuring (default: 3)"
    )
    parser.add_argument(
        "--profile-steps",
        type=positive_int,
        default=5,
        help="forwards recorded by torch.profiler per variant (default: 5)",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    parser.add_argument(
        "--mlp-activation",
        choices=MLP_ACTIVATIONS,
        default="gelu",
        help="activation between the mlp experiment's layers (default: gelu, exact)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("fusedmlp-profile"),
        help="output folder (default: ./fusedmlp-profile)",
    )
    return parser


def resolve_device(parser: argparse.ArgumentParser, text: str | None) -> torch.device:
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        parser.error(f"unknown device {text!r} (use cpu or cuda)")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"unsupported device {text!r} (use cpu or cuda)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {text} requested, but torch sees no CUDA GPU")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16, the dtype of the study's article and of the models our users convert, where
    the fused kernels run it at bfloat16 speed: on CUDA, and on a CPU whose bfloat16 unit in
    use multiplies bfloat16 in hardware (the registry's FMLP_BF16_NATIVE levels: there fused
    ran the Linear and the GeGLU block ~1.4-1.5x eager's speed, the MLP within a few percent
    of it either way); float32 on other CPUs, whose bfloat16 kernels multiply as floats."""
    if device.type == "cuda" or cpu_bf16_native():
        return torch.bfloat16
    return torch.float32


def parse_settings(argv: list[str] | None) -> StudySettings:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = resolve_device(parser, args.device)
    on_cuda = device.type == "cuda"
    return StudySettings(
        device=device,
        dtype=args.dtype or default_dtype(device),
        experiments=args.experiments,
        tokens=args.tokens,
        iters=args.iters or DEFAULT_ITERS["cuda" if on_cuda else "cpu"],
        warmup=args.warmup,
        profile_steps=args.profile_steps,
        compile=not args.no_compile,
        mlp_activation=args.mlp_activation,
        out=args.out,
    )


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prepare_variant(
    experiment: Experiment,
    variant: str,
    reference: torch.Tensor,
    settings: StudySettings,
    prefix: str,
) -> tuple[Model, Callable[[WallTime], VariantResult]]:
    """Everything but the wall time, which run_study measures with every variant taking turns:
    the model, and what makes its result from its wall time."""
    device, inputs = settings.device, experiment.inputs
    compiled = variant in (COMPILE, FUSED_COMPILE)
    log(f"{prefix}: {'compiling' if compiled else 'warming up'}...")
    model = variant_model(experiment, variant, device)
    with torch.inference_mode():
        first_call_s = warm_up(model, inputs, settings.warmup, device)
        output, inference = measure_call(lambda: model(inputs), device)
        check = check_output(output, reference)
        log(f"{prefix}: profiling {settings.profile_steps} forwards...")
        trace_file = f"{experiment.name}-{variant.replace('+', '-')}.json"
        profiled = profile_forward(
            model, inputs, settings.profile_steps, device, settings.out / trace_file
        )
    log(f"{prefix}: measuring the memory a forward saves for backward...")
    saved = saved_for_backward(model, inputs, device, compiled)
    whole = torch_sees_whole_peak(device, variant in (FUSED, FUSED_COMPILE))
    memory = ForwardMemory(inference.peak_bytes, saved, peak_is_whole=whole)
    log(f"{prefix}: {'matches' if check.matches_eager else 'does NOT match'} eager")
    return model, functools.partial(
        VariantResult,
        variant,
        trace_file,
        first_call_s,
        check,
        profiled.counts,
        profiled.op_tree,
        profiled.timeline,
        memory,
    )


def experiment_variants(experiment: Experiment, settings: StudySettings) -> tuple[str, ...]:
    return settings.variants + tuple(experiment.extra_variants)


def run_study(settings: StudySettings) -> list[ExperimentResult]:
    experiments = []
    for name in settings.experiments:
        tokens = settings.tokens or default_tokens(name, settings.device)
        experiments.append(
            build_experiment(name, tokens, settings.device, settings.dtype, settings.mlp_activation)
        )
    total = sum(len(experiment_variants(experiment, settings)) for experiment in experiments)
    step, results = 0, []
    for experiment in experiments:
        shape = tuple(experiment.inputs.shape)
        log(f"{experiment.name}: {experiment.description}; input {shape}, {settings.dtype}")
        for variant, reason in experiment.skipped.items():
            log(f"{experiment.name}: skipping {variant}: {reason}")
        with torch.inference_mode():
            reference = experiment.eager(experiment.inputs)
        prepared = {}
        for variant in experiment_variants(experiment, settings):
            step += 1
            prefix = f"[{step}/{total}] {experiment.name} / {variant}"
            prepared[variant] = prepare_variant(experiment, variant, reference, settings, prefix)
        log(f"{experiment.name}: timing {settings.iters} forwards per variant, taking turns...")
        with torch.inference_mode():
            models = {variant: model for variant, (model, _) in prepared.items()}
            walls = time_forwards(models, experiment.inputs, settings.iters, settings.device)
        variant_results = [finish(walls[variant]) for variant, (_, finish) in prepared.items()]
        for result in variant_results:
            median = format_ms(result.wall.median_ms)
            log(f"{experiment.name} / {result.variant}: {median} ms per forward (median)")
        results.append(
            ExperimentResult(
                experiment.name, experiment.description, shape, variant_results, experiment.skipped
            )
        )
    return results


def warn_if_overloaded(env: dict[str, str | int | float | None]) -> None:
    load, cores = env["load_average_1min"], env["cpu_count"]
    if isinstance(load, float) and isinstance(cores, int) and load > cores:
        log(f"warning: load average {load} on {cores} cores; other processes inflated the times")


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(argv)
    require_matplotlib("python -m fusedmlp.profile")
    quiet_kineto()
    settings.out.mkdir(parents=True, exist_ok=True)
    # Each variant runs its forwards under inference_mode, but the weights are made outside it:
    # the memory a forward saves for backward needs weights that autograd can use.
    experiments = run_study(settings)
    env = environment(settings.device)
    warn_if_overloaded(env)
    settings_json = settings.as_json()
    summary = summary_markdown(env, settings_json, experiments, CHART_FILE)
    (settings.out / SUMMARY_MD).write_text(summary)
    write_summary_json(settings.out / SUMMARY_JSON, env, settings_json, experiments)
    title = f"fusedmlp profile, {settings_json['device']} {settings_json['dtype']}"
    write_chart(settings.out / CHART_FILE, experiments, title)
    for experiment in experiments:
        lanes = [(result.variant, result.timeline) for result in experiment.variants]
        write_timeline(
            settings.out / timeline_file(experiment.name),
            f"{experiment.name}: one forward per variant ({title})",
            lanes,
        )
    print(summary)
    print(
        f"Wrote {SUMMARY_MD}, {SUMMARY_JSON}, {CHART_FILE}, one timeline per experiment and "
        f"one trace per variant to {settings.out.resolve()}"
    )
    return 0

