# Shell helpers shared by the bench scripts (sourced, not run).

free_port() { # below the ephemeral range, so that no client socket holds it
    local p
    while :; do
        p=$((10000 + RANDOM % 20000))
        (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }
    done
}

cluster_up() { # cluster_up TRIES PAUSE PORT...: waits until every node says cluster_state:ok
    local tries=$1 pause=$2 ok port
    shift 2
    for _ in $(seq "$tries"); do
        ok=0
        for port in "$@"; do
            redis-cli -p "$port" cluster info | grep -q cluster_state:ok && ok=$((ok + 1))
        done
        ((ok == $#)) && return
        sleep "$pause"
    done
}

cluster_urls() { # cluster_urls PORT...: redis://127.0.0.1:PORT/ of each, comma-separated
    local urls
    urls=$(printf 'redis://127.0.0.1:%s/,' "$@")
    echo "${urls%,}"
}
