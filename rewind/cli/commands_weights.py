"""Weights-stream commands: ``publish`` (publish the run's weights stream from its log, once
or as a service; ``--rebuild`` deletes the stream and publishes it again)."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Annotated

import typer

from rewind.cli.common import OK, AsJson, CoordUrl, LogUrl, RunDir, RunId, Snaps, Workers, address_of
from rewind.cli.output import emit_json, say

Dtype = Annotated[str, typer.Option("--dtype", help="serving dtype: bfloat16, float16 or float32")]
KeyframeEvery = Annotated[int, typer.Option("--keyframe-every", min=1, help="a keyframe every N versions")]
KeepKeyframes = Annotated[int, typer.Option(
    "--keep-keyframes", min=1, help="keep the N newest keyframes (and the patches after the oldest)")]
Follow = Annotated[bool, typer.Option("--follow", help="keep publishing new versions until interrupted")]
Interval = Annotated[float, typer.Option("--interval", min=0.01, help="seconds between polls of the log")]
Seconds = Annotated[float | None, typer.Option("--for", min=0.0, help="with --follow: stop after S s")]
Rebuild = Annotated[bool, typer.Option("--rebuild", help="delete the stream, publish it again from the log")]


def publish(
    dtype: Dtype = "bfloat16", keyframe_every: KeyframeEvery = 32, keep_keyframes: KeepKeyframes = 2,
    follow: Follow = False, interval: Interval = 1.0, seconds: Seconds = None, rebuild: Rebuild = False,
    workers: Workers = 2, json_out: AsJson = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> int:
    """Publish the run's weights stream: each sealed version's model cast to --dtype, as a
    patch against the version before, with a keyframe every --keyframe-every versions. Once,
    up to the newest sealed version, or with --follow as a service (one publisher per run:
    a newer one fences an older one)."""
    from eventlog.weightcodec import WeightsConfig
    from replayer.publisher import Publisher, PublishReport

    address = address_of(run_dir, log, coord, run, snapshots)
    with dataclasses.replace(address, read_only=True).open_log():
        pass  # the run's log must exist: publishing nothing creates nothing
    config = WeightsConfig(dtype=dtype, keyframe_every=keyframe_every, keep_keyframes=keep_keyframes)
    with Publisher(address, config, workers=workers) as pub:
        report = pub.rebuild() if rebuild else pub.publish()
        published, keyframes, payload = report.published, report.keyframes, report.payload_bytes
        if follow:
            done: list[PublishReport] = []

            def published_some(step: PublishReport) -> None:
                done.append(step)
                say(f"published up to version {pub.version}", to_stderr=json_out)

            until = None if seconds is None else time.monotonic() + seconds
            pub.follow(threading.Event(), interval, until=until, on_publish=published_some)
            published += sum(d.published for d in done)
            keyframes += sum(d.keyframes for d in done)
            payload += sum(d.payload_bytes for d in done)
        version = pub.version
    if json_out:
        emit_json("publish", True, run=address.run_id, dtype=config.dtype, published=published,
                  keyframes=keyframes, last_version=version, payload_bytes=payload)
    else:
        say(f"weights stream of {address.run_id} ({config.dtype}): published {published} versions "
            f"({keyframes} keyframes, {payload} payload bytes); newest version {version}")
    return OK
