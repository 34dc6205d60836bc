"""The scheduler's connection to its worker: one long-lived Execute stream.

One StepRequest goes out per engine step and exactly one StepResult comes
back. Any break in the stream surfaces as ``UnavailableError`` so that the
engine loop can fail the affected requests instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvmesh.protos import common_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.services.contracts.errors import UnavailableError, error_from_rpc
from kvmesh.services.contracts.step import ModelRunnerOutput, SchedulerOutput
from kvmesh.services.contracts.step_codec import (
    model_runner_output_from_proto,
    scheduler_output_to_proto,
)
from kvmesh.services.runtime.grpc_security import NO_INTERNAL_AUTH, InternalSecurity
from kvmesh.services.runtime.grpc_server import internal_channel, wait_until_serving

logger = logging.getLogger(__name__)


class WorkerClient:
    def __init__(self, address: str, security: InternalSecurity = NO_INTERNAL_AUTH) -> None:
        self.address = address
        self._security = security
        self._channel: grpc.aio.Channel | None = None
        self._stub: worker_pb2_grpc.WorkerStub | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        # Set when the step stream ends, also between steps: a worker that dies
        # idle must not wait for the next request to be found out (whose step
        # would be written into a dead stream).
        self.stream_ended = asyncio.Event()

    async def connect(self, timeout: float) -> worker_pb2.WorkerInfo:
        """Wait for the worker to be SERVING, open the step stream, return its info."""
        await self.close()
        await wait_until_serving(self.address, timeout, self._security)
        self._channel = internal_channel(self.address, self._security)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        info = await self._stub.GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=10)
        self._call = self._stub.Execute()
        self.stream_ended.clear()
        self._call.add_done_callback(lambda _: self.stream_ended.set())
        logger.info("attached to worker at %s", self.address)
        return info

    @property
    def connected(self) -> bool:
        return self._call is not None and not self._call.done()

    async def get_info(self, timeout: float = 5.0) -> worker_pb2.WorkerInfo:
        if self._stub is None:
            raise UnavailableError("worker not connected")
        try:
            return await self._stub.GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise UnavailableError(f"worker unreachable: {e.code().name} {e.details()}") from e

    async def prepare_structured_output(
        self, request_id: str, structured_output: common_pb2.StructuredOutput, timeout: float = 60.0
    ) -> None:
        """Have the worker compile a grammar; InvalidRequestError if it does not compile."""
        if self._stub is None:
            raise UnavailableError("worker not connected")
        try:
            await self._stub.PrepareStructuredOutput(
                worker_pb2.PrepareStructuredOutputRequest(
                    request_id=request_id, structured_output=structured_output
                ),
                timeout=timeout,
            )
        except grpc.aio.AioRpcError as e:
            # The worker's verdict passes on as is: a grammar that does not
            # compile stays the caller's INVALID_REQUEST.
            raise error_from_rpc(e) from e

    async def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Send one step and wait for its result (synchronous scheduling)."""
        await self.submit(scheduler_output)
        return await self.receive(scheduler_output.step_id)

    async def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Send one step without waiting for it; results come back in submit order."""
        if self._call is None:
            raise UnavailableError("worker not connected")
        try:
            await self._call.write(scheduler_output_to_proto(scheduler_output))
        except grpc.aio.AioRpcError as e:
            self._call = None
            raise UnavailableError(f"worker stream failed: {e.code().name} {e.details()}") from e

    async def receive(self, step_id: int) -> ModelRunnerOutput:
        """The result of the oldest submitted step, which must be ``step_id``."""
        if self._call is None:
            raise UnavailableError("worker not connected")
        try:
            result = await self._call.read()
        except grpc.aio.AioRpcError as e:
            self._call = None
            raise UnavailableError(f"worker stream failed: {e.code().name} {e.details()}") from e
        if result is grpc.aio.EOF:
            self._call = None
            raise UnavailableError("worker closed the step stream")
        if result.step_id != step_id:
            self._call = None
            raise UnavailableError(f"worker answered step {result.step_id} to step {step_id}")
        return model_runner_output_from_proto(result)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
