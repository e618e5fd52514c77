"""``llmctl check PIPELINE.yaml``: quantize -> serve -> bench -> eval -> gates, one verdict.

Exit codes: 0 every gate passed (for a matrix: at least one candidate passed, or all of
them with --require-all); 1 a gate failed (each listed); 2 the pipeline file, a gate or
the command line is malformed; 3 a step failed (named, with its log's last lines).
The work is in :mod:`llmctl.check`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmctl.cli.errors import guarded
from llmctl.cli.options import JsonOpt, JunitOpt

Opt = typer.Option
PipelineArg = Annotated[Path, typer.Argument(help="Pipeline YAML (see examples/check-*.yaml).",
                                             show_default=False)]
Baseline = Annotated[Path | None, Opt("--baseline", help="report.json of an earlier check: "
                                      "the values '*baseline' gates compare with.")]
OutputDir = Annotated[Path, Opt("--output", "-o", help="Directory for report.json/.md/.html, "
                                "bench and eval reports and server logs.")]
Force = Annotated[list[str] | None, Opt("--force", help="Redo a cached step: quantize | eval "
                                        "(repeatable).")]
RequireAll = Annotated[bool, Opt("--require-all",
                                 help="A matrix passes only if every candidate does.")]


def register(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def check(
        pipeline: PipelineArg,
        baseline: Baseline = None,
        output: OutputDir = Path("check-out"),
        force: Force = None,
        require_all: RequireAll = False,
        junit: JunitOpt = None,
        json_: JsonOpt = False,
    ) -> None:
        """Quantize, serve, bench and evaluate a model from one pipeline file; gate on it."""
        import time

        from llmctl.check import outputs
        from llmctl.check import report as check_report
        from llmctl.check.judge import baseline_entry, judge, precheck
        from llmctl.check.pipeline import load_pipeline
        from llmctl.check.ranking import Row, rank
        from llmctl.check.runner import CheckRunner
        from llmctl.cli.output import Output

        out = Output(json_)
        spec = load_pipeline(pipeline)
        base = check_report.load_baseline(baseline) if baseline else None
        precheck(spec, base)
        runner = CheckRunner(spec, output, force=set(force or ()), out=out)
        runner.validate()
        start = time.perf_counter()
        runs = runner.run()
        gates = spec.parsed_gates()
        results = {run.name: judge(gates, run, baseline_entry(base, run.name)) for run in runs}
        throughput = f"bench.{spec.bench[0].name}.output_throughput" if spec.bench else None
        ranking = rank([Row(r.name, r.metrics, all(g.passed for g in results[r.name]))
                        for r in runs], throughput)
        report = check_report.build(spec.model_dump(mode="json"), runs, results, ranking,
                                    require_all=require_all,
                                    baseline=str(baseline) if baseline else None,
                                    seconds=time.perf_counter() - start)
        paths = outputs.write(report, results, output, junit, warn=out.warn)
        out.status("wrote " + ", ".join(str(p) for p in paths.values()))

        def render(console) -> None:
            from rich.markdown import Markdown

            console.print(Markdown(check_report.markdown(report)))

        out.result(report, render)
        for entry in results.values():
            for r in entry:
                if r.warning:
                    out.warn(r.warning)
        if not report["verdict"]["passed"]:
            listing = "; ".join(f"{f['candidate']}: {f['gate']}"
                                for f in report["verdict"]["failed_gates"])
            out.error(f"gates failed: {listing}", f"see {paths['md']}")
            raise typer.Exit(check_report.EXIT_GATE_FAILED)
