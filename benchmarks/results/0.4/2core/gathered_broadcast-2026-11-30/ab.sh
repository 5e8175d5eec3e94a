#!/bin/bash
# alternate the tree at HEAD ("new") and at dd3b336 ("old") for ferro-collective's sources
cd /work/main
for r in 1 2 3 4 5; do
  for v in new old; do
    if [ $v = old ]; then git checkout -q dd3b336 -- packages/ferro-collective/src; else git checkout -q HEAD -- packages/ferro-collective/src; fi
    for n in 3 4; do
      /work/venv/bin/python /tmp/s18/bmsg.py $n shipped 100 4096,65536 | sed "s/\"mode\": \"shipped\"/\"mode\": \"$v\"/" >> /tmp/s18/bmsg3.jsonl
    done
  done
done
git checkout -q HEAD -- packages/ferro-collective/src
echo AB_DONE
