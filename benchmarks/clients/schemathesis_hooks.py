"""schemathesis' positive-data check, made exact for this server: which 400s a valid body may get.

What it is: a schemathesis extension (`hooks` in `schemathesis.toml` beside this file loads it
for the CLI; tests/test_level6_clients.py imports `listed_refusal`). A body `/openapi.json`
admits may still be refused by a rule no JSON schema can state (a prompt's length in tokens, a
grammar that does not compile, two fields that disagree): such a 400 carries its own `code`,
listed under the operation's 400 as `x-refusals` (level6_serving/protocol.py's REFUSALS). The
configuration lets the positive-data check expect a 400, and the check below then fails every
400 to a valid body whose code is not listed: a hole in the document, as before.

What it is not: a relaxed check. Without this file schemathesis can only count a listed
refusal as a failure (every one of them, each time a fuzzer makes a prompt too long) or
accept every 400 (holes included).
"""

from __future__ import annotations

import schemathesis


def listed_refusal(case, response) -> str | None:
    """The code of a 400 that the operation lists in x-refusals; None for any other answer."""
    if response.status_code != 400:
        return None
    listed = case.operation.definition.raw.get("responses", {}).get("400", {}).get("x-refusals", {})
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if code in listed else None


@schemathesis.check
def valid_data_refused_only_by_a_listed_rule(ctx, response, case):
    """A 400 to a generated valid body must carry a code the operation lists (x-refusals)."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
        return None
    if listed_refusal(case, response) is None:
        raise AssertionError(f"Valid data refused with a code the document does not list: {response.text[:300]}")
    return None
