"""Regenerate ``schemas/*.schema.json`` from the pydantic models (tests fail when the two drift apart).

python tools/gen_schemas.py [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from routelog.format.documents import json_schemas

SCHEMAS = Path(__file__).resolve().parent.parent / "schemas"


def rendered() -> dict[Path, str]:
    return {
        SCHEMAS / f"{name}.schema.json": json.dumps(schema, indent=2, sort_keys=True) + "\n"
        for name, schema in json_schemas().items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed schema differs")
    args = parser.parse_args()
    stale = [path for path, text in rendered().items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"stale: {path}")
        return 1 if stale else 0
    for path, text in rendered().items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
