"""vLLM 0.32's engine flags (``vllm serve``'s EngineArgs), for ``anyio-genout serve``.

A flag that concerns the engine is passed on to managed engines (``--vllm-model``, or the
positional model) and otherwise refused with one line saying to give it to the engine
(``vllm serve --headless ...``). The lists are static (derived from
``AsyncEngineArgs.add_cli_args`` of vLLM 0.32.0, less the flags the front end handles
itself: the data-parallel address, port and size, ``--served-model-name``, ``--model``,
``--max-logprobs``, ``--shutdown-timeout``, ``--stream-interval``, ``--generation-config``,
``--override-generation-config``, ``--tokenizer``, the drain of ``serve`` itself);
tests/interop/test_vllm_flags.py checks them against vLLM's parser.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

__all__ = ["ENGINE_FLAGS", "ENGINE_SWITCHES", "split_engine_flags"]

#: Engine flags that take a value (``--flag VALUE`` or ``--flag=VALUE``), without ``--``.
ENGINE_FLAGS: Final[frozenset[str]] = frozenset((
    "additional-config", "all2all-backend", "allowed-local-media-path",
    "allowed-media-domains", "attention-backend", "attention-config", "aux-output-config",
    "block-size", "code-revision", "collect-detailed-traces", "compilation-config",
    "config-format", "convert", "cp-kv-cache-interleave-size",
    "cpu-distributed-timeout-seconds", "cpu-offload-gb", "cpu-offload-params",
    "cudagraph-capture-sizes", "custom-histogram-buckets", "data-parallel-backend",
    "data-parallel-rank", "data-parallel-size-local", "data-parallel-start-rank",
    "dbo-decode-token-threshold", "dbo-prefill-token-threshold", "dcp-comm-backend",
    "dcp-kv-cache-interleave-size", "decode-context-parallel-size", "default-mm-loras",
    "device-ids", "device-memory-utilization", "diffusion-config",
    "distributed-executor-backend", "distributed-timeout-seconds", "download-dir",
    "dp-sync-interval", "dtype", "ec-manager-config", "ec-transfer-config",
    "elastic-ep-max-dp-size", "engram-config", "eplb-config", "expert-placement-strategy",
    "fault-tolerance-config", "gdn-prefill-backend",
    "gpu-memory-utilization", "hf-config-path", "hf-overrides", "hf-token", "ignore-patterns",
    "io-processor-plugin", "ir-op-priority", "jit-monitor-mode", "kda-decode-backend",
    "kda-prefill-backend", "kernel-config", "kv-cache-dtype", "kv-cache-dtype-skip-layers",
    "kv-cache-memory-bytes", "kv-cache-metrics-sample", "kv-events-config",
    "kv-offloading-backend", "kv-offloading-size", "kv-transfer-config", "limit-mm-per-prompt",
    "linear-backend", "load-format", "log-config-file", "log-level", "logging-config",
    "logits-processors", "logprobs-mode", "long-prefill-token-threshold", "lora-dtype",
    "lora-target-modules", "mamba-backend", "mamba-block-size", "mamba-cache-dtype",
    "mamba-cache-mode", "mamba-cache-philox-rounds", "mamba-ssm-cache-dtype",
    "mamba-ssu-algorithm", "master-addr", "master-port", "max-cpu-loras",
    "max-cudagraph-capture-size", "max-lora-cls-labels", "max-lora-rank",
    "max-loras", "max-model-len", "max-num-active-seqs", "max-num-batched-tokens",
    "max-num-queued-reqs", "max-num-queued-tokens", "max-num-scheduled-tokens", "max-num-seqs",
    "max-parallel-loading-workers", "media-io-kwargs", "mm-encoder-attn-backend",
    "mm-encoder-attn-dtype", "mm-encoder-fp8-scale-path", "mm-encoder-fp8-scale-save-margin",
    "mm-encoder-fp8-scale-save-path", "mm-encoder-tp-mode", "mm-hasher-algorithm",
    "mm-ipc-gpu-memory-gb", "mm-processor-cache-gb", "mm-processor-cache-type",
    "mm-processor-device", "mm-processor-kwargs", "mm-shm-cache-max-object-size-mb",
    "mm-tensor-ipc", "model-class-overrides", "model-impl", "model-loader-extra-config",
    "moe-backend", "nnodes", "node-rank", "num-gpu-blocks-override", "numa-bind-cpus",
    "numa-bind-nodes", "offload-backend", "offload-group-size", "offload-num-in-group",
    "offload-params", "offload-prefetch-step", "optimization-level", "otlp-traces-endpoint",
    "per-request-spec-decode-metrics", "performance-mode",
    "pipeline-parallel-size", "pooler-config", "prefill-context-parallel-size",
    "prefill-schedule-interval", "prefix-cache-retention-interval", "prefix-caching-hash-algo",
    "prefix-match-unit", "profiler-config", "pt-load-map-location", "quantization",
    "quantization-config", "reasoning-config", "reasoning-parser-plugin",
    "renderer-num-workers", "replayssm-buffer-len", "revision", "runner",
    "safetensors-load-strategy", "safetensors-prefetch-block-size",
    "safetensors-prefetch-num-threads", "scheduler-cls", "scheduling-policy", "seed",
    "show-hidden-metrics-for-version", "sleep-preserve-parameter-names",
    "sparse-indexer-topk-backend", "spec-method", "spec-model", "spec-tokens",
    "speculative-config", "structured-outputs-config",
    "tensor-parallel-size", "tokenizer-mode", "tokenizer-revision", "ubatch-size",
    "video-pruning-method", "video-pruning-rate", "watermark", "watermark-config",
    "weight-transfer-config", "worker-cls", "worker-extension-cls",
))

#: Engine flags that take no value (switches, and their ``--no-`` forms), without ``--``.
ENGINE_SWITCHES: Final[frozenset[str]] = frozenset((
    "aggregate-engine-logging", "allow-deprecated-quantization", "async-scheduling",
    "cudagraph-metrics", "data-parallel-external-lb", "data-parallel-hybrid-lb",
    "data-parallel-multi-port-external-lb", "dcp-q-replicate", "disable-cascade-attn",
    "disable-chunked-mm-input", "disable-custom-all-reduce", "disable-hybrid-kv-cache-manager",
    "disable-log-stats", "disable-nccl-for-dp-synchronization", "disable-sliding-window",
    "enable-batch-sharded-sampling", "enable-chunked-prefill", "enable-cumem-allocator",
    "enable-dbo", "enable-elastic-ep", "enable-ep-weight-filter", "enable-eplb",
    "enable-expert-parallel", "enable-fault-tolerance", "enable-flashinfer-autotune",
    "enable-hc-sp", "enable-layerwise-nvtx-tracing", "enable-log-requests",
    "enable-logging-iteration-details", "enable-lora",
    "enable-mamba-cache-stochastic-rounding", "enable-mamba-shared-prefix-checkpoint",
    "enable-mfu-metrics", "enable-mixed-moe-lora-format", "enable-mm-embeds",
    "enable-moe-shared-loras", "enable-nccl-comm-suspend", "enable-prefix-caching",
    "enable-prompt-embeds", "enable-return-routed-experts", "enable-shm-tensor-arena",
    "enable-sleep-mode", "enable-tower-connector-lora", "enable-trace-replay", "enforce-eager",
    "fail-on-environ-validation", "fully-sharded-loras", "interleave-mm-strings",
    "jit-monitor-verbose", "kv-cache-metrics", "kv-sharing-fast-prefill",
    "language-model-only", "long-prefill-token-threshold-adaptive", "mm-device-do-normalize",
    "mm-encoder-only", "no-allow-deprecated-quantization", "no-async-scheduling",
    "no-cudagraph-metrics", "no-data-parallel-external-lb", "no-data-parallel-hybrid-lb",
    "no-dcp-q-replicate", "no-disable-cascade-attn", "no-disable-chunked-mm-input",
    "no-disable-custom-all-reduce", "no-disable-hybrid-kv-cache-manager",
    "no-disable-nccl-for-dp-synchronization", "no-disable-sliding-window",
    "no-enable-batch-sharded-sampling", "no-enable-chunked-prefill",
    "no-enable-cumem-allocator", "no-enable-dbo", "no-enable-elastic-ep",
    "no-enable-ep-weight-filter", "no-enable-eplb", "no-enable-expert-parallel",
    "no-enable-fault-tolerance", "no-enable-flashinfer-autotune", "no-enable-hc-sp",
    "no-enable-layerwise-nvtx-tracing", "no-enable-log-requests",
    "no-enable-logging-iteration-details", "no-enable-lora",
    "no-enable-mamba-cache-stochastic-rounding", "no-enable-mamba-shared-prefix-checkpoint",
    "no-enable-mfu-metrics", "no-enable-mixed-moe-lora-format", "no-enable-mm-embeds",
    "no-enable-moe-shared-loras", "no-enable-nccl-comm-suspend", "no-enable-prefix-caching",
    "no-enable-prompt-embeds", "no-enable-return-routed-experts", "no-enable-shm-tensor-arena",
    "no-enable-sleep-mode", "no-enable-tower-connector-lora", "no-enable-trace-replay",
    "no-enforce-eager", "no-fail-on-environ-validation", "no-fully-sharded-loras",
    "no-interleave-mm-strings", "no-jit-monitor-verbose", "no-kv-cache-metrics",
    "no-kv-sharing-fast-prefill", "no-language-model-only",
    "no-long-prefill-token-threshold-adaptive", "no-mm-device-do-normalize",
    "no-mm-encoder-only", "no-numa-bind", "no-ray-workers-use-nsight",
    "no-return-sampling-mask", "no-scheduler-reserve-full-isl", "no-skip-mm-profiling",
    "no-skip-tokenizer-init", "no-sleep-mode-offload-cudagraph", "no-specialize-active-lora",
    "no-swa-bounded-replay", "no-trust-remote-code", "no-use-fp64-gumbel", "no-use-replayssm",
    "no-use-tqdm-on-load", "numa-bind", "ray-workers-use-nsight", "return-sampling-mask",
    "scheduler-reserve-full-isl", "skip-mm-profiling", "skip-tokenizer-init",
    "sleep-mode-offload-cudagraph", "specialize-active-lora", "swa-bounded-replay",
    "trust-remote-code", "use-fp64-gumbel", "use-replayssm", "use-tqdm-on-load",
))

#: ``serve`` options whose value is passed through unread (it may look like a flag).
_OPAQUE_VALUES: Final = frozenset(("--vllm-arg", "--vllm-command"))


def split_engine_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``serve``'s arguments split in two: the rest, and vLLM's engine flags with their
    values (in order, as the engine is to be given them). Stops at ``--``. Raises
    nothing: what is neither is left to the argument parser."""
    rest: list[str] = []
    engine: list[str] = []
    items = iter(argv)
    for item in items:
        name = item.split("=", 1)[0]
        if item == "--":
            rest.append(item)
            rest.extend(items)
            break
        if name in _OPAQUE_VALUES:
            rest.append(item)
            value = None if "=" in item else next(items, None)
            if value is not None:
                rest.append(value)
            continue
        if name.startswith("--") and name[2:] in ENGINE_SWITCHES and "=" not in item:
            engine.append(item)
        elif name.startswith("--") and name[2:] in ENGINE_FLAGS:
            engine.append(item)
            if "=" not in item:
                value = next(items, None)
                if value is not None:
                    engine.append(value)
        else:
            rest.append(item)
    return rest, engine
