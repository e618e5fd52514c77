"""Build one engine: validate the request, run the target, write the manifest atomically.

The engine directory appears only when everything succeeded (``atomic_dir``); a failed
or interrupted build leaves nothing that looks like an engine.
"""

from __future__ import annotations

import datetime as _dt
import os
import shlex
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from llmctl import __version__
from llmctl.engines.host import Host
from llmctl.engines.manifest import BuildInfo, EngineManifest, SourceInfo, write_manifest
from llmctl.engines.options import CommonOptions, validate_options
from llmctl.engines.source import resolve_source
from llmctl.engines.targets import BuildContext, get_target
from llmctl.utils.atomic import atomic_dir


def build_command(model: str, target: str, output: Path, common: CommonOptions,
                  options: dict) -> str:
    """The command line that rebuilds this engine (recorded in the manifest)."""
    parts = ["llmctl", "build-engine", model, "--target", target, "-o", str(output),
             "--precision", common.precision]
    if common.device != "cpu":
        parts += ["--device", common.device]
    if common.max_batch_size != CommonOptions.model_fields["max_batch_size"].default:
        parts += ["--max-batch-size", str(common.max_batch_size)]
    if common.max_seq_len:
        parts += ["--max-seq-len", str(common.max_seq_len)]
    for key, value in options.items():
        parts += ["--option", f"{key}={value}"]
    return shlex.join(parts)


def build_engine(model: str, target: str, output: Path, *, common: CommonOptions | None = None,
                 options: dict | None = None, overwrite: bool = False,
                 log: Callable[[str], None] = lambda message: None,
                 progress=None) -> EngineManifest:
    common = common or CommonOptions()
    options = dict(options or {})
    output = Path(output)
    kind = get_target(target)
    if common.precision is None:
        common = common.model_copy(update={"precision": kind.default_precision})
    target_options = validate_options(kind.Options, options, target)
    kind.check_request(common, target_options)
    if output.exists() and not overwrite:
        raise FileExistsError(output)
    log(f"resolving {model}")
    source = resolve_source(model, progress)
    kind.check_source(source)
    command = build_command(model, target, output, common, options)
    with atomic_dir(output, overwrite=overwrite) as tmp, \
            tempfile.TemporaryDirectory(prefix="llmctl-build-") as work:
        start = time.perf_counter()
        result = kind.build(BuildContext(source=source, out=tmp, workdir=Path(work),
                                         common=common, options=target_options, log=log))
        seconds = time.perf_counter() - start
        try:
            load = [round(x, 2) for x in os.getloadavg()]
        except OSError:
            load = None
        manifest = EngineManifest(
            target=target,
            precision=common.precision,
            source=SourceInfo(reference=model, path=str(source.path),
                              model_type=source.model_type, sha256=source.sha256,
                              quantization=source.describe_quantization()),
            requirements=result.requirements,
            built_on=Host.probe().describe(tuple(result.requirements.cpu_flags)),
            build=BuildInfo(
                llmctl_version=__version__,
                date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                seconds=round(seconds, 2), command=command, tool=result.tool,
                options={**common.model_dump(), **target_options.model_dump()},
                machine_load=load),
            serve_command=result.serve_command or f"llmctl serve {shlex.quote(str(output))}",
            target_info=result.target_info,
            notes=result.notes,
        )
        manifest = write_manifest(tmp, manifest)
    return manifest
