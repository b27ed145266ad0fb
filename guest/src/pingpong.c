/*
 * pingpong - TCP request/response latency probe.
 *
 *   pingpong server PORT
 *   pingpong client IP PORT [-s BYTES] [-t TIMEOUT_SECS]
 *
 * The server echoes every byte it receives (one forked process per client).
 * The client sends a request of BYTES bytes (default 64; the first 8 bytes
 * carry a sequence number), waits for the full echo, checks the sequence
 * number and sends the next one. Every second it prints
 *
 *   pingpong: t=<s> conn=<n> reqs=<replies this interval> total=<n> maxgap_ms=<ms> maxgap_all_ms=<ms>
 *
 * maxgap_ms is the longest time between two consecutive replies seen in the
 * interval, counting a gap still in progress (so a stall shows up while it
 * lasts). Gaps span reconnections: they measure the service outage.
 * On connection loss (EOF, error, wrong echo, or no reply for TIMEOUT_SECS,
 * default 30) the client says so and reconnects once a second; conn= counts
 * successful connections. It never exits.
 */
#include "common.h"

#include <sys/wait.h>

#define DEFAULT_SIZE 64u
#define MAX_SIZE (16u * 1024 * 1024)

static void usage(void)
{
    fprintf(stderr,
            "usage: pingpong server PORT\n"
            "       pingpong client IP PORT [-s BYTES] [-t TIMEOUT_SECS]\n"
            "  -s BYTES    request (and reply) size, 8..%u (default %u)\n"
            "  -t SECS     reconnect when no reply came for SECS (default 30)\n",
            MAX_SIZE, DEFAULT_SIZE);
    exit(2);
}

/* ---------------------------------------------------------------- server */

static void serve_client(int fd)
{
    char buf[65536];
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        if (write_all(fd, buf, (size_t)n) != 0)
            break;
    }
    close(fd);
}

static int run_server(uint16_t port)
{
    int lfd = listen_tcp(port, "pingpong");
    signal(SIGCHLD, SIG_IGN); /* children are reaped automatically */
    printf("pingpong: server listening on port %u\n", port);
    for (;;) {
        struct sockaddr_in peer;
        socklen_t plen = sizeof peer;
        int fd = accept(lfd, (struct sockaddr *)&peer, &plen);
        if (fd < 0) {
            if (errno != EINTR)
                sleep(1);
            continue;
        }
        set_nodelay(fd);
        char ip[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &peer.sin_addr, ip, sizeof ip);
        printf("pingpong: server client %s:%u connected\n", ip, ntohs(peer.sin_port));
        pid_t pid = fork();
        if (pid == 0) {
            close(lfd);
            serve_client(fd);
            printf("pingpong: server client %s:%u closed\n", ip, ntohs(peer.sin_port));
            _exit(0);
        }
        if (pid < 0)
            fprintf(stderr, "pingpong: fork: %s\n", strerror(errno));
        close(fd);
    }
}

/* ---------------------------------------------------------------- client */

static int run_client(struct in_addr ip, uint16_t port, uint32_t size, int64_t timeout_ms)
{
    char *req = malloc(size), *rep = malloc(size);
    if (req == NULL || rep == NULL) {
        fprintf(stderr, "pingpong: out of memory\n");
        return 1;
    }
    for (uint32_t i = 0; i < size; i++)
        req[i] = (char)('a' + i % 26);

    char ipstr[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &ip, ipstr, sizeof ipstr);

    int64_t t0 = now_ms();
    int64_t next_report = t0 + 1000;
    int64_t next_connect = t0;
    int64_t last_reply = -1; /* time of the latest reply, -1 before the first */
    int64_t last_progress = t0;
    int64_t maxgap = 0, maxgap_all = 0;
    uint64_t conn = 0, reqs = 0, total = 0, seq = 0, failures = 0;
    int fd = -1;
    int sending = 1;
    uint32_t off = 0;

    for (;;) {
        int64_t now = now_ms();

        if (fd < 0 && now >= next_connect) {
            const char *err = "";
            fd = connect_tcp(&ip, port, 1000, &err);
            now = now_ms();
            if (fd < 0) {
                /* Say it on the first failure and then every 10th, not every second. */
                if (failures++ % 10 == 0)
                    printf("pingpong: t=%" PRId64 " connect to %s:%u failed: %s\n",
                           (now - t0) / 1000, ipstr, port, err);
                next_connect = now + 1000;
            } else {
                failures = 0;
                conn++;
                unsigned to = (unsigned)timeout_ms;
                setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &to, sizeof to);
                set_nonblock(fd, 1);
                printf("pingpong: t=%" PRId64 " conn=%" PRIu64 " connected to %s:%u\n",
                       (now - t0) / 1000, conn, ipstr, port);
                sending = 1;
                off = 0;
                last_progress = now;
            }
        }

        if (now >= next_report) {
            int64_t gap = last_reply >= 0 ? now - last_reply : 0;
            if (gap > maxgap)
                maxgap = gap;
            if (maxgap > maxgap_all)
                maxgap_all = maxgap;
            printf("pingpong: t=%" PRId64 " conn=%" PRIu64 " reqs=%" PRIu64 " total=%" PRIu64
                   " maxgap_ms=%" PRId64 " maxgap_all_ms=%" PRId64 "\n",
                   (now - t0) / 1000, conn, reqs, total, maxgap, maxgap_all);
            reqs = 0;
            maxgap = 0;
            next_report += 1000;
            if (next_report <= now)
                next_report = now + 1000;
        }

        int64_t wait = next_report - now;
        if (fd < 0) {
            if (next_connect - now < wait)
                wait = next_connect - now;
            if (wait > 0)
                poll(NULL, 0, (int)wait);
            continue;
        }

        const char *lost = NULL;
        struct pollfd p = { .fd = fd, .events = sending ? POLLOUT : POLLIN };
        int rc = poll(&p, 1, (int)(wait > 0 ? wait : 0));
        now = now_ms();
        if (rc < 0 && errno != EINTR) {
            lost = strerror(errno);
        } else if (rc > 0) {
            /* Move as many bytes as the socket takes without blocking. */
            for (;;) {
                if (sending) {
                    if (off == 0)
                        memcpy(req, &seq, sizeof seq);
                    ssize_t n = send(fd, req + off, size - off, 0);
                    if (n < 0) {
                        if (errno != EAGAIN && errno != EINTR)
                            lost = strerror(errno);
                        break;
                    }
                    off += (uint32_t)n;
                    if (off == size) {
                        sending = 0;
                        off = 0;
                        last_progress = now;
                    }
                } else {
                    ssize_t n = recv(fd, rep + off, size - off, 0);
                    if (n == 0) {
                        lost = "closed by peer";
                        break;
                    }
                    if (n < 0) {
                        if (errno != EAGAIN && errno != EINTR)
                            lost = strerror(errno);
                        break;
                    }
                    off += (uint32_t)n;
                    last_progress = now;
                    if (off < size)
                        continue;
                    uint64_t got;
                    memcpy(&got, rep, sizeof got);
                    if (got != seq) {
                        lost = "reply does not match the request";
                        break;
                    }
                    now = now_ms();
                    if (last_reply >= 0 && now - last_reply > maxgap)
                        maxgap = now - last_reply;
                    last_reply = now;
                    reqs++;
                    total++;
                    seq++;
                    sending = 1;
                    off = 0;
                }
            }
        }
        if (lost == NULL && !sending && now - last_progress > timeout_ms)
            lost = "no reply within the timeout";
        if (lost != NULL) {
            printf("pingpong: t=%" PRId64 " conn=%" PRIu64 " lost: %s\n", (now - t0) / 1000, conn,
                   lost);
            close(fd);
            fd = -1;
            next_connect = now + 1000;
        }
    }
}

int main(int argc, char **argv)
{
    line_buffered();
    if (argc == 3 && strcmp(argv[1], "server") == 0) {
        uint16_t port;
        if (parse_port(argv[2], &port) != 0)
            usage();
        return run_server(port);
    }
    if (argc >= 4 && strcmp(argv[1], "client") == 0) {
        struct in_addr ip;
        uint16_t port;
        uint64_t size = DEFAULT_SIZE, timeout = 30;
        if (inet_pton(AF_INET, argv[2], &ip) != 1) {
            fprintf(stderr, "pingpong: '%s' is not an IPv4 address\n", argv[2]);
            usage();
        }
        if (parse_port(argv[3], &port) != 0)
            usage();
        for (int i = 4; i < argc; i += 2) {
            if (i + 1 >= argc)
                usage();
            if (strcmp(argv[i], "-s") == 0) {
                if (parse_u64(argv[i + 1], &size) != 0 || size < 8 || size > MAX_SIZE)
                    usage();
            } else if (strcmp(argv[i], "-t") == 0) {
                if (parse_u64(argv[i + 1], &timeout) != 0 || timeout == 0 || timeout > 3600)
                    usage();
            } else {
                usage();
            }
        }
        return run_client(ip, port, (uint32_t)size, (int64_t)timeout * 1000);
    }
    usage();
    return 2;
}
