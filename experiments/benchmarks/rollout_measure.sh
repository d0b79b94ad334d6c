#!/bin/bash
# The rollout measurement: both sides at 4K, then promote/rollback under a 50-request bench.
# Server first, from the repository root:
#   nice -n 10 python -m serving --config results/serving/rollout/canary.yaml > server.log 2>&1 &
cd "$(git rev-parse --show-toplevel)"
URL=http://127.0.0.1:8191; KEY=rollout-key; OUT=${OUT:-runs/rollout}; mkdir -p $OUT
until curl -sf $URL/health > /dev/null; do sleep 5; done
date -u +%T > $OUT/t_ready
curl -s $URL/metrics > $OUT/metrics0.txt
nice -n 10 .venv/bin/python -m serving.bench --url $URL --api-key $KEY --requests 16 --rate 0.1 \
  --context-len 4096 --max-tokens 16 --ignore-eos --out $OUT/bench_4k.json > $OUT/bench_4k.log 2>&1
curl -s $URL/metrics > $OUT/metrics1.txt
curl -s $URL/admin/rollout -H "Authorization: Bearer $KEY" > $OUT/rollout1.json
date -u +%T > $OUT/t_bench1
# Promote / rollback under load.
nice -n 10 .venv/bin/python -m serving.bench --url $URL --api-key $KEY --requests 50 --rate 1 \
  --context-len 1024 --max-tokens 16 --ignore-eos --out $OUT/bench_load.json > $OUT/bench_load.log 2>&1 &
BENCH=$!
post() { curl -s -X POST $URL/admin/rollout -H "Authorization: Bearer $KEY" \
  -H 'Content-Type: application/json' -d "$1" >> $OUT/admin_posts.jsonl; echo >> $OUT/admin_posts.jsonl; }
sleep 8; post '{"action": "promote"}'
sleep 8; post '{"action": "rollback"}'
sleep 8; post '{"action": "set_share", "share": 0.1}'
sleep 8; post '{"action": "rollback"}'
sleep 8; post '{"action": "set_share", "share": 0.5}'
wait $BENCH; echo "bench exit $?" >> $OUT/bench_load.log
curl -s $URL/metrics > $OUT/metrics2.txt
curl -s $URL/admin/rollout -H "Authorization: Bearer $KEY" > $OUT/rollout2.json
date -u +%T > $OUT/t_done
