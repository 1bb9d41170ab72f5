"""docs/architecture.md's record sections against the records themselves: each record's bullet (or
paragraph) names every field it has, so a field added to a record without its words in the docs
fails here."""
from __future__ import annotations

import dataclasses
import os
import re

import pytest
from helpers import REPO

from records import deltas, engine_stats, outputs, step

# Record -> the record whose bullet (or paragraph) in docs/architecture.md describes its fields.
DOCUMENTED_IN = {"SchedulerOutput": "SchedulerOutput", "ScheduledRequest": "ScheduledRequest",
                 "ModelRunnerOutput": "ModelRunnerOutput", "SampledToken": "ModelRunnerOutput",
                 "RequestOutput": "RequestOutput", "CompletionOutput": "RequestOutput",
                 "StepDelta": "StepDelta", "ChoiceDelta": "StepDelta", "EngineStats": "EngineStats",
                 "ReplicaStats": "EngineStats"}


def _descriptions() -> dict[str, str]:
    """Each documented record's text: a bullet `- \\`Name\\`...` up to the next bullet or blank line, or
    the paragraph that starts `records/<module>.py: Name`."""
    with open(os.path.join(REPO, "docs", "architecture.md")) as f:
        text = f.read()
    out = {}
    for name in set(DOCUMENTED_IN.values()):
        m = (re.search(rf"^- `{name}`[^\n]*(?:\n  [^\n]*)*", text, re.M)
             or re.search(rf"^`records/\w+.py: {name}`[^\n]*(?:\n[^\n]+)*", text, re.M))
        assert m, f"docs/architecture.md describes no {name}"
        out[name] = m.group(0)
    return out


@pytest.mark.parametrize("record", sorted(DOCUMENTED_IN))
def test_the_architecture_doc_names_every_field_of_the_records(record):
    named = set(re.findall(r"[A-Za-z_]\w*", " ".join(re.findall(r"`([^`]+)`", _descriptions()[DOCUMENTED_IN[record]]))))
    module = next(m for m in (step, outputs, deltas, engine_stats) if hasattr(m, record))
    missing = [f.name for f in dataclasses.fields(getattr(module, record)) if f.name not in named]
    assert not missing, f"docs/architecture.md's {DOCUMENTED_IN[record]} says nothing of {record}.{missing}"
