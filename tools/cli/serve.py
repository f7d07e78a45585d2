"""`llmc serve`: an artifact over the OpenAI-compatible HTTP API, in this process or as Ray Serve replicas."""

from __future__ import annotations

import contextlib
import dataclasses
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


def _names(ctx, param, values: tuple[str, ...]) -> tuple[str, ...]:
    """A repeatable option whose values may also be comma-separated: `--allowed-hosts a,b --allowed-hosts c`."""
    return tuple(name.strip() for value in values for name in value.split(",") if name.strip())


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
    help="Sequences (n per request) that may wait beyond --max-num-seqs; more get 429 with Retry-After [default: 256].",
)
@click.option(
    "--shutdown-timeout",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds requests in flight get to finish after SIGTERM or Ctrl-C; then they are cut [default: 30].",
)
@click.option(
    "--header-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Seconds a connection has to send its request line and headers; then 408 and closed [default: 10].",
)
@click.option(
    "--body-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Seconds a request has to send its whole body; then 408 [default: 30].",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    default=None,
    help="Open connections; a request on one more gets 503 [default: 512].",
)
@click.option(
    "--keep-alive-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Seconds an idle kept-alive connection stays open; keep it past your clients' own idle expiry [default: 75].",
)
@click.option(
    "--api-key",
    envvar="LLMC_API_KEY",
    default=None,
    show_envvar=True,
    help="Require `Authorization: Bearer <key>` on /v1 (401 otherwise); /health and /metrics stay open.",
)
@click.option(
    "--allowed-hosts",
    multiple=True,
    callback=_names,
    help="Host names to answer besides the bound address (and the localhost names when bound to loopback; "
    "this machine's names and IP addresses when bound to 0.0.0.0 or ::), comma-separated or repeated; `*` for "
    "any. Other Host headers get 400: a DNS-rebinding page sends its own name.",
)
@click.option(
    "--allowed-origins",
    multiple=True,
    callback=_names,
    help="Web origins (e.g. https://app.example.com, or `*`) that browsers may let call the API (CORS) "
    "[default: none].",
)
@click.option(
    "--allowed-methods",
    multiple=True,
    callback=_names,
    help="With --allowed-origins: the methods CORS allows [default: GET,POST].",
)
@click.option(
    "--allowed-headers",
    multiple=True,
    callback=_names,
    help="With --allowed-origins: the request headers CORS allows [default: Authorization,Content-Type].",
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
    default=None,
    help="With --ray: replicas, each loading the artifact once [default: 1].",
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
    header_timeout: float | None,
    body_timeout: float | None,
    max_connections: int | None,
    keep_alive_timeout: float | None,
    api_key: str | None,
    allowed_hosts: tuple[str, ...],
    allowed_origins: tuple[str, ...],
    allowed_methods: tuple[str, ...],
    allowed_headers: tuple[str, ...],
    no_prefix_caching: bool,
    speculative: str | None,
    num_speculative_tokens: int,
    draft: Path | None,
    quant,
    kv_cache_dtype: str,
    use_ray: bool,
    address: str | None,
    replicas: int | None,
    threads_per_replica: int | None,
    autoscale: str | None,
) -> None:
    """Serve ARTIFACT over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models),
    with /health and Prometheus metrics at /metrics."""
    from llmc.runtime import server
    from llmc.runtime.server.sites import hosts_for

    ray_only = {
        "--replicas": replicas,
        "--address": address,
        "--threads-per-replica": threads_per_replica,
        "--autoscale": autoscale,
    }
    given_without_ray = [name for name, value in ray_only.items() if value is not None and not use_ray]
    if given_without_ray:
        raise LlmcError(
            f"{', '.join(given_without_ray)} applies to `llmc serve --ray` only",
            "add --ray (pip install 'llmc[ray]'), or drop it",
        )
    not_on_ray = {
        "--header-timeout": header_timeout,
        "--max-connections": max_connections,
        "--keep-alive-timeout": keep_alive_timeout,
    }
    given_with_ray = [name for name, value in not_on_ray.items() if value is not None and use_ray]
    if given_with_ray:  # Ray Serve's HTTP proxy holds the connections
        raise LlmcError(
            f"{', '.join(given_with_ray)} applies to `llmc serve` without --ray",
            "Ray Serve's HTTP proxy has its own settings (serve.start(http_options=...))",
        )
    if (allowed_methods or allowed_headers) and not allowed_origins:
        raise LlmcError(
            "--allowed-methods and --allowed-headers apply with --allowed-origins",
            "name the origins too, e.g. --allowed-origins https://app.example.com",
        )
    policy = hosts_for(host, allowed_hosts)
    cors = {"allowed_origins": allowed_origins, "allowed_methods": allowed_methods, "allowed_headers": allowed_headers}
    sites = dataclasses.replace(policy, **{k: v for k, v in cors.items() if v})
    ray_serve = _ray_serve_module() if use_ray else None  # before any compile: a missing extra fails at once
    given = {
        "max_body_bytes": max_body_size,
        "max_n": max_n,
        "max_waiting_requests": max_waiting_requests,
        "shutdown_timeout_s": shutdown_timeout,
        "header_timeout_s": header_timeout,
        "body_timeout_s": body_timeout,
        "max_connections": max_connections,
        "keep_alive_s": keep_alive_timeout,
    }
    limits = server.ServerLimits(**{k: v for k, v in given.items() if v is not None})  # unset: the library's default
    path = resolve_artifact(artifact, quant, kv_cache_dtype)
    app_kw = dict(
        path=path.resolve(),
        name=model_name or artifact.resolve().name,
        limits=limits,
        api_key=api_key or None,
        sites=sites,
        kv_cache_memory=kv_cache_memory,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        no_prefix_caching=no_prefix_caching,
        speculative=speculative,
        num_speculative_tokens=num_speculative_tokens,
        draft=None if draft is None else resolve_artifact(draft).resolve(),
    )
    if ray_serve is not None:
        return _serve_on_ray(ray_serve, app_kw, host, port, address, replicas or 1, threads_per_replica, autoscale)
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
