# Shell helpers shared by benches/run.sh and benches/instructions.sh (sourced, not run).

free_port() { # below the ephemeral range, so that no client socket holds it
    local p
    while :; do
        p=$((10000 + RANDOM % 20000))
        (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }
    done
}
