# Sourced by the GPU benchmark scripts: a run that outlasts one call of the device tool goes on in
# the background on the machine, in a directory of its own, and later calls wait for it.
#   background_start RUN_DIR COMMAND [ARG ...]   starts COMMAND there, in a session of its own
#   background_wait RUN_DIR SECONDS              waits up to SECONDS; says "finished" or not
# A lent machine goes back about 30 s after a call ends, and the run with it: keep a `wait` call
# going, one after another, until it says finished.
# The tree is sourced for the GPU environment first and copied into RUN_DIR, so later calls'
# fresh copies of the tree cannot change the running code.

background_start() {
  local run=$1
  shift
  [ -e "$run/pid" ] && kill -0 "$(cat "$run/pid")" 2>/dev/null && {
    echo "a run is already going (pid $(cat "$run/pid"))"; return 2; }
  rm -rf "$run" && mkdir -p "$run"
  . .ci/gpu-env.sh > "$run/env.log" 2>&1
  cp -r benchmarks tf_ucudnn tests pyproject.toml "$run"/
  # The pid is written from inside the new session: setsid forks, so $! would be setsid's own,
  # gone while the run goes on.
  (cd "$run" && CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONPATH="$run:$PYTHONPATH" \
    run="$run" setsid nohup bash -c 'echo $$ > pid; exec "$@"' bash "$@" \
      > "$run/log" 2>&1 &)
  for _ in $(seq 50); do [ -s "$run/pid" ] && break; sleep 0.1; done
  echo "started pid $(cat "$run/pid")"
}

background_wait() {
  local run=$1 deadline=$((SECONDS + ${2:-500}))
  while kill -0 "$(cat "$run/pid")" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 5; done
  kill -0 "$(cat "$run/pid")" 2>/dev/null && echo "still running" || echo "finished"
}
