"""Reads the documented flags, defaults and choices out of the vLLM CLI reference
(``tests/data/vllm_server_usage.txt``, the newest seed document)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

REFERENCE = Path(__file__).parent / "data" / "vllm_server_usage.txt"


@dataclasses.dataclass
class SeedFlag:
    flag: str
    section: str
    default: str | None
    choices: list[str] | None


def seed_flags(section_prefix: str) -> dict[str, SeedFlag]:
    """Flags documented in sections starting with ``section_prefix`` (e.g. "2.3")."""
    flags: dict[str, SeedFlag] = {}
    section = ""
    current: SeedFlag | None = None
    lines = REFERENCE.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        heading = re.match(r"^(\d+\.\d+(?:\.\d+)?)\.\s", line)
        if heading:
            section = heading.group(1)
            current = None
        elif line.startswith("-") and section.startswith(section_prefix):
            first = line.split()[0].rstrip(",")
            if first.startswith("--") or first in ("-q", "-i", "-o"):
                long = next((t.rstrip(",") for t in line.split() if t.startswith("--")), first)
                choices = None
                found = re.search(r"\{([^}]*)\}", line)
                if found:
                    choices = [c.strip() for c in found.group(1).split(",")]
                current = SeedFlag(long, section, None, choices)
                flags[long] = current
        elif line.removeprefix("+ ").startswith("Default:") and current is not None:
            value = line.removeprefix("+ ").removeprefix("Default:").strip()
            if not value and i + 2 < len(lines) and lines[i + 2].strip() == "{":
                # A multi-line JSON default (the compilation config).
                block = []
                j = i + 2
                while j < len(lines) and not lines[j].startswith("}"):
                    block.append(lines[j])
                    j += 1
                value = "\n".join([*block, "}"])
            current.default = value
            current = None
        i += 1
    return flags
