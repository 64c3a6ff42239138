"""A fake worker in a process of its own, for router tests of a worker that dies under a
request: `python tests/crashing_worker.py ROUTER WORKER_ID PORT` serves fake_worker's
`FakeWorker` on PORT and registers with the router as WORKER_ID. A request whose text
starts with "crash" ends the process at once (exit 75, as a tensor-parallel group does
when a rank's step fails inside a collective): a real process death, which the router
sees through gRPC as it sees a real worker's. Prints "SERVING" once it serves.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_worker import FakeWorker  # noqa: E402

from cluster.exit_codes import EXIT_TRANSIENT  # noqa: E402
from cluster.worker.registration import Registration  # noqa: E402


class CrashingWorker(FakeWorker):
    async def Generate(self, request, context):
        if request.text.startswith("crash"):
            os._exit(EXIT_TRANSIENT)
        async for chunk in super().Generate(request, context):
            yield chunk


async def main(router: str, worker_id: str, port: int) -> None:
    worker = await CrashingWorker(worker_id, token_delay=0.02).start(port)
    registration = Registration(router, worker.address, worker.load_report, join_token="tok", worker_id=worker_id,
                                interval=0.2)
    registration.start()
    print("SERVING", flush=True)
    await worker.server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
