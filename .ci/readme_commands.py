"""Prints the README's Quickstart commands, one per line, exactly as written there.

CI runs these and nothing else, so when the README's commands change, CI follows them.
The Quickstart is the first ```sh block after the "## Quickstart" heading.
"""

import sys
from pathlib import Path


def quickstart(readme: str) -> list[str]:
    lines = readme.splitlines()
    start = lines.index("## Quickstart")
    fence = next(i for i in range(start, len(lines)) if lines[i].strip() == "```sh")
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].strip() == "```")
    return [ln.strip() for ln in lines[fence + 1 : end] if ln.strip()]


if __name__ == "__main__":
    cmds = quickstart(Path(sys.argv[1] if len(sys.argv) > 1 else "README.md").read_text())
    if len(cmds) != 2:
        sys.exit(f"readme_commands: the Quickstart must hold exactly 2 commands, found {len(cmds)}")
    print("\n".join(cmds))
