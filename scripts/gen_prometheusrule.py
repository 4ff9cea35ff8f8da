"""Writes deploy/monitoring/prometheusrule.yaml (the Prometheus Operator's form)
from deploy/monitoring/alerts.yaml (the rule file promtool checks), so the alert
rules are written once.

    .venv/bin/python scripts/gen_prometheusrule.py           # rewrite it
    .venv/bin/python scripts/gen_prometheusrule.py --check   # exit 1 if it drifted

tests/server/test_monitoring.py checks it the same way.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy/monitoring/alerts.yaml"
OUT = ROOT / "deploy/monitoring/prometheusrule.yaml"
HEAD = """\
# Prometheus Operator: the alert rules of alerts.yaml, generated from it by
# scripts/gen_prometheusrule.py (edit alerts.yaml, then run it). Give it a label
# your Prometheus' ruleSelector picks up (kube-prometheus: release: <its name>).
"""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL) as literal blocks, as alerts.yaml writes them."""


def _text(dumper: yaml.SafeDumper, data: str) -> Any:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _text)


def render() -> str:
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "kvsvc", "labels": {"app.kubernetes.io/name": "kvsvc"}},
        "spec": yaml.safe_load(RULES.read_text()),
    }
    return HEAD + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail on drift, write nothing")
    args = parser.parse_args()
    want = render()
    if args.check:
        if OUT.read_text() != want:
            print(f"{OUT.relative_to(ROOT)} drifted: run scripts/gen_prometheusrule.py")
            return 1
        return 0
    OUT.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
