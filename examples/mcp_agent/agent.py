"""An agent's side of `wasibox mcp`: start the server over stdio and use its tools.

A real agent is a model choosing the tool calls; here they are scripted, to show what the
model sees: a workspace and an interpreter that persist across calls of one session (until
reset, or a call that exceeds a limit), and refusals as results, not crashes.

Usage: python examples/mcp_agent/agent.py   (needs the 'mcp' extra: pip install 'wasibox[mcp]')
"""

import asyncio
import pathlib
import sys

from mcp import Client, StdioServerParameters

HERE = pathlib.Path(__file__).resolve().parent


def text(result: object) -> str:
    return "\n".join(part.text for part in result.content)  # type: ignore[attr-defined]


async def main() -> None:
    server = StdioServerParameters(
        command=sys.executable, args=["-m", "wasibox", "mcp", "--config",
                                      str(HERE / "agent.toml")])
    async with Client(server, read_timeout_seconds=120) as client:
        tools = [tool.name for tool in (await client.list_tools()).tools]
        print("tools:", ", ".join(sorted(tools)))
        await client.call_tool("write_file", {"path": "numbers.txt", "content": "3\n4\n5\n"})
        code = ("total = sum(int(n) for n in open('/workspace/numbers.txt'))\n"
                "open('/workspace/total.txt', 'w').write(str(total))\nprint(total)")
        print("run_python ->", text(await client.call_tool("run_python", {"code": code})))
        print("read_file total.txt ->",
              text(await client.call_tool("read_file", {"path": "total.txt"})))
        # The interpreter is the same one: `total` is still defined.
        kept = text(await client.call_tool("run_python", {"code": "print(total * 2)"}))
        print("next call ->", kept.splitlines()[2])
        refused = ("import urllib.request\n"
                   "urllib.request.urlopen('http://169.254.169.254/latest/meta-data/')")
        denied = text(await client.call_tool("run_python", {"code": refused}))
        print("metadata URL ->", denied.splitlines()[0])
        spun = text(await client.call_tool("run_python", {"code": "while True: pass"}))
        print("endless loop ->", spun.splitlines()[0])


if __name__ == "__main__":
    asyncio.run(main())
