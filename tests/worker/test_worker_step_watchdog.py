"""A step past its deadline turns the worker's liveness (and readiness) off, on the real
health service."""

from __future__ import annotations

import asyncio

from kvmesh.services.contracts.step_deadline import StepDeadline, StepDeadlinePolicy
from kvmesh.services.runtime.grpc_server import LIVENESS_SERVICE, GrpcService
from kvmesh.services.runtime.healthcheck import check_grpc
from kvmesh.worker.step_watchdog import StepWatchdog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_liveness_fails_while_a_step_is_overdue_and_recovers_after() -> None:
    service = GrpcService("worker", [])
    port = await service.start("127.0.0.1", 0)
    address = f"127.0.0.1:{port}"

    async def alive() -> bool:
        result = await asyncio.to_thread(check_grpc, address, LIVENESS_SERVICE)
        return result.healthy

    async def ready() -> bool:
        return (await asyncio.to_thread(check_grpc, address)).healthy

    try:
        assert await alive()  # alive from the start, before it is ready
        assert not await ready()
        await service.set_serving(True)  # the model is loaded
        clock = Clock()
        policy = StepDeadlinePolicy(min_s=1.0, cold_s=30.0, warm_steps=2)
        watchdog = StepWatchdog(StepDeadline(policy), service.set_alive_and_ready, clock=clock)
        with watchdog.step(8):
            clock.now = 29.0  # cold: the first steps may be slow
            await watchdog.check()
            assert await alive()
            clock.now = 31.0
            await watchdog.check()
            assert not await alive() and not await ready()
        await watchdog.check()
        assert await alive() and await ready()
        with watchdog.step(8):  # the second cold step; the third is measured
            clock.now += 0.01
        with watchdog.step(8):
            clock.now += 0.01
        with watchdog.step(8):  # warm now: the floor applies
            clock.now += 1.5
            await watchdog.check()
            assert not await alive()
    finally:
        await service.stop(grace=0)
