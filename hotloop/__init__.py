"""hotloop: the library every service and app imports (config, bus, telemetry, gRPC helpers,
clients, generated stubs, models)."""

import os as _os

# gRPC's fork support off in every hotloop process (and, through the environment, in every
# child it starts) unless the user set it. With it on, a child forked by `subprocess` while
# this process has active channels can restart gRPC's poller before its exec; `close_fds`
# then closes the poller's epoll fd and the child aborts (SIGABRT, "epoll_wait error: Bad
# file descriptor"; grpc/grpc#43055). hotloop never uses gRPC in a forked child: every child
# is exec'd, or (vLLM's engine core, the sandboxes) speaks no gRPC.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
