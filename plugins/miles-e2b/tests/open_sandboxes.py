"""Opens COUNT e2b sandboxes tagged with RUN_ID (in WORKDIR), says ``open`` on stdout and waits to be
killed: a run SIGKILLed with sandboxes open, for the gc test. Usage: open_sandboxes.py RUN_ID COUNT WORKDIR"""

import asyncio
import sys

from miles_e2b import E2BSandbox


async def main(run_id: str, count: int, workdir: str) -> None:
    boxes = [E2BSandbox(run_id=run_id, workdir=workdir) for _ in range(count)]
    await asyncio.gather(*(box.run("true", timeout_s=60) for box in boxes))
    print("open", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
