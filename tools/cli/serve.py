"""`llmc serve`: an artifact over the OpenAI-compatible HTTP API, in this process or as Ray Serve replicas."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import time
from pathlib import Path

import click

from llmc.errors import LlmcError
from llmc.tools.engine_setup import ray_replica_app, resolve_artifact, server_app

from .options import kv_cache_dtype_option, no_prefix_caching, quant_options, speculative_options


def _byte_size(text: str) -> int:
    from llmc.runtime.kv_cache import parse_memory_size

    try:
        return parse_memory_size(text)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--model-name", default=None, help="The model id clients send and see [default: the artifact's name].")
@click.option(
    "--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True, help="Most sequences in one step."
)
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Most tokens in one step (prefill chunks and decodes together).",
)
@click.option("--kv-cache-memory", default=None, help="KV cache size, e.g. 4GiB (default: 20% of free memory).")
@click.option(
    "--max-body-size",
    default=None,
    callback=lambda ctx, param, v: None if v is None else _byte_size(v),
    help="Largest request body, e.g. 16MiB; larger ones get 413 [default: 4MiB].",
)
@click.option("--max-n", type=click.IntRange(min=1), default=None, help="Most choices (n) per request [default: 16].")
@click.option(
    "--max-waiting-requests",
    type=click.IntRange(min=0),
    default=None,
    help="Requests that may wait beyond --max-num-seqs; more get 429 with Retry-After [default: 256].",
)
@click.option(
    "--shutdown-timeout",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds requests in flight get to finish after SIGTERM or Ctrl-C; then they are cut [default: 30].",
)
@click.option(
    "--api-key",
    envvar="LLMC_API_KEY",
    default=None,
    show_envvar=True,
    help="Require `Authorization: Bearer <key>` on /v1 (401 otherwise); /health and /metrics stay open.",
)
@no_prefix_caching
@speculative_options
@quant_options
@kv_cache_dtype_option
@click.option(
    "--ray",
    "use_ray",
    is_flag=True,
    help="Serve on Ray Serve: --replicas copies of this server behind Ray's HTTP proxy, with "
    "prefix-affinity routing (needs pip install 'llmc[ray]').",
)
@click.option(
    "--address",
    default=None,
    help="With --ray: the Ray cluster to join (e.g. 10.0.0.1:6379 or auto) [default: start a local one].",
)
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --ray: replicas, each loading the artifact once.",
)
@click.option(
    "--threads-per-replica",
    type=click.IntRange(min=1),
    default=None,
    help="With --ray and a CPU artifact: each replica's threads and Ray CPUs [default: this machine's "
    "cores / --replicas].",
)
@click.option(
    "--autoscale",
    default=None,
    help="With --ray: MIN:MAX replicas, scaled on requests in flight, or a JSON file of Ray Serve's "
    "autoscaling_config; replaces --replicas.",
)
def serve(
    artifact: Path,
    host: str,
    port: int,
    model_name: str | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_memory: str | None,
    max_body_size: int | None,
    max_n: int | None,
    max_waiting_requests: int | None,
    shutdown_timeout: float | None,
    api_key: str | None,
    no_prefix_caching: bool,
    speculative: str | None,
    num_speculative_tokens: int,
    draft: Path | None,
    quant,
    kv_cache_dtype: str,
    use_ray: bool,
    address: str | None,
    replicas: int,
    threads_per_replica: int | None,
    autoscale: str | None,
) -> None:
    """Serve ARTIFACT over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models),
    with /health and Prometheus metrics at /metrics."""
    from llmc.runtime import server

    ray_serve = _ray_serve_module() if use_ray else None  # before any compile: a missing extra fails at once
    given = {
        "max_body_bytes": max_body_size,
        "max_n": max_n,
        "max_waiting_requests": max_waiting_requests,
        "shutdown_timeout_s": shutdown_timeout,
    }
    limits = server.ServerLimits(**{k: v for k, v in given.items() if v is not None})  # unset: the library's default
    path = resolve_artifact(artifact, quant, kv_cache_dtype)
    app_kw = dict(
        path=path.resolve(),
        name=model_name or artifact.resolve().name,
        limits=limits,
        api_key=api_key or None,
        kv_cache_memory=kv_cache_memory,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        no_prefix_caching=no_prefix_caching,
        speculative=speculative,
        num_speculative_tokens=num_speculative_tokens,
        draft=None if draft is None else resolve_artifact(draft).resolve(),
    )
    if ray_serve is not None:
        return _serve_on_ray(ray_serve, app_kw, host, port, address, replicas, threads_per_replica, autoscale)
    with contextlib.ExitStack() as stack:
        app, model = server_app(stack, **app_kw)
        click.echo(
            f"serving {app_kw['name']} ({model.num_blocks} KV blocks of {model.block_size} tokens) on "
            f"http://{host}:{port}/v1",
            err=True,
        )
        server.serve(app, host, port)


def ray_serve_options(
    path: Path, limits, max_num_seqs: int, replicas: int, threads_per_replica: int | None, autoscale: str | None
):
    """RayServeOptions for an artifact: a CUDA one takes a GPU per replica, a CPU one its threads in CPUs."""
    from llmc.artifact import load_artifact
    from llmc.runtime.ray_serve import RayServeOptions

    target = load_artifact(path, verify=False, check_target=False).target
    common = dict(
        replicas=replicas,
        limits=limits,
        autoscaling=_autoscaling_config(autoscale),
        max_ongoing_requests=max_num_seqs + limits.max_waiting_requests,
    )
    if target.get("name") != "cpu":
        return RayServeOptions(num_cpus=1, num_gpus=1, **common)
    threads = threads_per_replica or max(1, (os.cpu_count() or 1) // replicas)
    return RayServeOptions(num_cpus=threads, env={"OMP_NUM_THREADS": str(threads)}, **common)


def _autoscaling_config(text: str | None) -> dict | None:
    if text is None:
        return None
    low, sep, high = text.partition(":")
    if sep and low.isdigit() and high.isdigit():
        if not 0 <= int(low) <= int(high) or int(high) < 1:
            raise LlmcError(f"--autoscale {text}: MIN:MAX needs 0 <= MIN <= MAX and MAX >= 1", "e.g. --autoscale 1:4")
        return {"min_replicas": int(low), "max_replicas": int(high)}
    try:
        config = json.loads(Path(text).read_text())
    except (OSError, ValueError) as e:
        raise LlmcError(
            f"--autoscale {text}: neither MIN:MAX nor a readable JSON file ({e})",
            "pass e.g. 1:4, or a JSON file of Ray Serve's autoscaling_config",
        ) from None
    if not isinstance(config, dict):
        raise LlmcError(f"--autoscale {text}: the JSON file must hold one object", 'e.g. {"max_replicas": 4}')
    return config


def _ray_serve_module():
    try:
        from llmc.runtime import ray_serve
    except ImportError as e:
        raise LlmcError(
            f"--ray needs Ray Serve, which is not installed ({e})",
            "pip install 'llmc[ray]'  (or: pip install 'ray[serve]==2.60.0')",
        ) from None
    return ray_serve


def _serve_on_ray(
    ray_serve,
    app_kw: dict,
    host: str,
    port: int,
    address: str | None,
    replicas: int,
    threads_per_replica: int | None,
    autoscale: str | None,
) -> None:
    options = ray_serve_options(
        app_kw["path"], app_kw["limits"], app_kw["max_num_seqs"], replicas, threads_per_replica, autoscale
    )
    ray_serve.start_ray(address, None if address else max(os.cpu_count() or 1, replicas * options.num_cpus))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # as Ctrl-C: through `finally`, which stops Serve and Ray
    try:
        ray_serve.deploy(functools.partial(ray_replica_app, **app_kw), options, host=host, port=port)
        count = f"autoscaled {autoscale}" if autoscale else f"{replicas} replica(s)"
        click.echo(f"serving {app_kw['name']} on Ray Serve ({count}) at http://{host}:{port}/v1", err=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        ray_serve.shutdown()
