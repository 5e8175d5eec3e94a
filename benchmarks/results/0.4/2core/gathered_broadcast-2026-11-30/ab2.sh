#!/bin/bash
# alternate ferro-collective's sources at bcast-cap ("new") and at 542ba0f ("old")
cd /work/main
for r in 1 2 3 4 5 6; do
  for v in new old; do
    if [ $v = old ]; then git checkout -q 542ba0f -- packages/ferro-collective/src; else git checkout -q bcast-cap -- packages/ferro-collective/src; fi
    for n in 3 4; do
      /work/venv/bin/python /tmp/s18/bcast.py $n shipped 100 131072,262144 | sed "s/\"mode\": \"shipped\"/\"mode\": \"$v\"/" >> /tmp/s18/bcast.jsonl
    done
  done
done
git checkout -q bcast-cap -- packages/ferro-collective/src
echo AB_DONE
