"""Enumerations that flags accept, declared once: the packages that act on them import these.

``kvmesh.scheduler.policy`` maps each scheduling policy name to its class,
``kvmesh.gateway.routing.policies`` each routing policy name,
``kvmesh.gateway.routing.discovery`` each replica discovery name,
``kvmesh.kernels.registry`` each attention backend name, ``kvmesh.worker.config`` each
dtype name to a torch dtype; tests check that each of them covers exactly the
names declared here.
"""

from __future__ import annotations

from enum import StrEnum


class SchedulingPolicyName(StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"


SCHEDULING_POLICIES: tuple[str, ...] = tuple(p.value for p in SchedulingPolicyName)


class RoutingPolicyName(StrEnum):
    """How the gateway picks an engine replica for a request (kvmesh.gateway.routing)."""

    KV = "kv"
    LOAD = "load"
    ROUND_ROBIN = "round-robin"


ROUTING_POLICIES: tuple[str, ...] = tuple(p.value for p in RoutingPolicyName)


class ReplicaDiscoveryName(StrEnum):
    """Where the gateway learns which engine replicas exist (kvmesh.gateway.routing.discovery)."""

    STATIC = "static"
    FILE = "file"
    DNS = "dns"


REPLICA_DISCOVERIES: tuple[str, ...] = tuple(d.value for d in ReplicaDiscoveryName)

# In the order the worker tries them on CPU; "triton" is CUDA's (or Triton's
# interpreter when forced by name).
ATTENTION_BACKENDS = ("cpu_native", "cpu", "triton", "torch_reference")

# Compute dtypes the worker accepts, by torch's names.
DTYPES = ("float32", "float16", "bfloat16")
# What --dtype accepts: a dtype, or "auto" (chosen by the hardware: worker/dtype_choice.py).
AUTO_DTYPE = "auto"
DTYPE_CHOICES = (AUTO_DTYPE, *DTYPES)
# What --quantization accepts: weight-only int8 per 32 input features (Q8_0's
# layout), or the same weights with int8 activations (W8A8, integer dot products).
QUANTIZATIONS = ("int8", "w8a8")
# What --kv-cache-dtype accepts, vLLM's names (kvmesh.kernels.kv_quant): auto (the
# model dtype), int8, fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2.
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
# --runner and --convert, as vLLM's: which runner serves the checkpoint (auto: by its
# architecture), and what a generation checkpoint becomes under the pooling runner.
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")

# --reasoning-parser: how a model's thinking is split from its answer (kvmesh.gateway.reasoning).
REASONING_PARSERS = ("qwen3", "deepseek_r1", "mistral")
# --tool-call-parser: each family's tool-call format (kvmesh.gateway.tool_calling.registry).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
