#!/usr/bin/env bash
# Run pytest in one rank of a multi-process launch with its own log ($OUT/<suite>-rank<N>.log):
# interleaved dots from several ranks are unreadable, and a hung collective must not hide the
# failure report (per-test timeout, thread method: dumps stacks and exits); skips say why (-rs:
# a preset too big for the card, no JAX GPU backend).
log="${OUT:-/tmp}/${SUITE:-gpu}-rank${RANK:-0}.log"
python3 -m pytest -q -p no:cacheprovider -o addopts= -rfEs --tb=short \
  --timeout="${TEST_TIMEOUT:-150}" --timeout-method=thread "$@" > "$log" 2>&1
rc=$?
echo "rank ${RANK:-0}: $(tail -n 1 "$log")"
exit $rc
