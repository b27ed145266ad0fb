/*
 * kvload - load generator and checker for kvserver.
 *
 *   kvload IP PORT [-k KEYS] [-P PREFIX] [-t TIMEOUT_SECS]
 *
 * Sends one request at a time: a SET of a random key (of KEYS, default 1000)
 * to a new value, or a GET of a random key, half and half. It remembers the
 * last value it SET for every key, and checks that every GET returns it
 * (NONE for a key it never set). Keys are named PREFIX.<n>; the default
 * prefix is <hostname>-<random>, so several kvloads can share one server.
 *
 * If the connection is lost while a SET is in flight, the server may or may
 * not have applied it: the next GET of that key accepts either value.
 * A wrong answer is counted in errors=, printed as KVLOAD-MISMATCH (at most
 * 10 lines per second), and the checker then adopts the server's value so
 * each lost update is counted once.
 *
 * Every second:
 *   kvload: t=<s> ops=<this interval> total=<n> errors=<n> conn=<n>
 * On connection loss (EOF, error, or no reply for TIMEOUT_SECS, default 30)
 * it says so and reconnects once a second; conn= counts connections.
 */
#include "common.h"

#include <getopt.h>

#define MAX_PREFIX 64
#define MAX_MISMATCH_LINES 10

enum { KNOWN = 0, MAYBE = 1, UNKNOWN = 2 };

/* What the server should hold for one key; value 0 means "not set". */
struct shadow {
    uint64_t val;
    uint64_t alt; /* the other possible value when state == MAYBE */
    uint8_t state;
};

static void usage(void)
{
    fprintf(stderr, "usage: kvload IP PORT [-k KEYS] [-P PREFIX] [-t TIMEOUT_SECS]\n"
                    "  -k KEYS     number of distinct keys (default 1000)\n"
                    "  -P PREFIX   key prefix (default <hostname>-<random>)\n"
                    "  -t SECS     reconnect when no reply came for SECS (default 30)\n");
    exit(2);
}

static void fmt_val(char *buf, size_t len, uint64_t v)
{
    if (v == 0)
        snprintf(buf, len, "NONE");
    else
        snprintf(buf, len, "v%" PRIu64, v);
}

int main(int argc, char **argv)
{
    uint64_t nkeys = 1000, timeout = 30;
    char prefix[MAX_PREFIX + 1] = "";
    int opt;

    line_buffered();
    /* glibc's getopt moves the positional arguments after the options. */
    while ((opt = getopt(argc, argv, "k:P:t:h")) != -1) {
        switch (opt) {
        case 'k':
            if (parse_u64(optarg, &nkeys) != 0 || nkeys == 0 || nkeys > 10000000)
                usage();
            break;
        case 't':
            if (parse_u64(optarg, &timeout) != 0 || timeout == 0 || timeout > 3600)
                usage();
            break;
        case 'P':
            if (strlen(optarg) == 0 || strlen(optarg) > MAX_PREFIX || strpbrk(optarg, " \t\r\n"))
                usage();
            strcpy(prefix, optarg);
            break;
        default:
            usage();
        }
    }
    if (argc - optind != 2)
        usage();
    char **pos = argv + optind;
    struct in_addr ip;
    uint16_t port;
    if (inet_pton(AF_INET, pos[0], &ip) != 1) {
        fprintf(stderr, "kvload: '%s' is not an IPv4 address\n", pos[0]);
        usage();
    }
    if (parse_port(pos[1], &port) != 0)
        usage();

    uint64_t rng = rng_seed();
    if (prefix[0] == '\0') {
        char host[65] = "guest";
        gethostname(host, sizeof host - 1);
        host[sizeof host - 1] = '\0';
        host[40] = '\0';
        snprintf(prefix, sizeof prefix, "%s-%04x", host, (unsigned)(rng_next(&rng) & 0xffff));
    }
    struct shadow *sh = calloc(nkeys, sizeof *sh);
    if (sh == NULL) {
        fprintf(stderr, "kvload: out of memory\n");
        return 1;
    }
    printf("kvload: server=%s:%u keys=%" PRIu64 " prefix=%s\n", pos[0], port, nkeys, prefix);

    int64_t t0 = now_ms(), next_report = t0 + 1000, next_connect = t0, last_progress = t0;
    uint64_t conn = 0, ops = 0, total = 0, errors = 0, counter = 0, failures = 0;
    unsigned mismatch_lines = 0;
    int fd = -1;
    /* The request in flight. */
    char req[2 * MAX_PREFIX + 64], rep[512];
    size_t req_len = 0, req_off = 0, rep_len = 0;
    int sending = 0, in_flight = 0, is_set = 0;
    uint64_t key = 0, newval = 0;

    for (;;) {
        int64_t now = now_ms();

        if (fd < 0 && now >= next_connect) {
            const char *err = "";
            fd = connect_tcp(&ip, port, 1000, &err);
            now = now_ms();
            if (fd < 0) {
                if (failures++ % 10 == 0)
                    printf("kvload: t=%" PRId64 " connect to %s:%u failed: %s\n", (now - t0) / 1000,
                           pos[0], port, err);
                next_connect = now + 1000;
            } else {
                failures = 0;
                conn++;
                unsigned to = (unsigned)timeout * 1000;
                setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &to, sizeof to);
                set_nonblock(fd, 1);
                printf("kvload: t=%" PRId64 " conn=%" PRIu64 " connected to %s:%u\n",
                       (now - t0) / 1000, conn, pos[0], port);
                in_flight = 0;
                last_progress = now;
            }
        }

        if (now >= next_report) {
            printf("kvload: t=%" PRId64 " ops=%" PRIu64 " total=%" PRIu64 " errors=%" PRIu64
                   " conn=%" PRIu64 "\n",
                   (now - t0) / 1000, ops, total, errors, conn);
            ops = 0;
            mismatch_lines = 0;
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

        if (!in_flight) {
            key = rng_next(&rng) % nkeys;
            is_set = (rng_next(&rng) >> 32) & 1;
            if (is_set) {
                newval = ++counter;
                req_len = (size_t)snprintf(req, sizeof req, "SET %s.%" PRIu64 " v%" PRIu64 "\n",
                                           prefix, key, newval);
            } else {
                req_len = (size_t)snprintf(req, sizeof req, "GET %s.%" PRIu64 "\n", prefix, key);
            }
            req_off = rep_len = 0;
            sending = 1;
            in_flight = 1;
            last_progress = now;
        }

        const char *lost = NULL;
        struct pollfd p = { .fd = fd, .events = sending ? POLLOUT : POLLIN };
        int rc = poll(&p, 1, (int)(wait > 0 ? wait : 0));
        now = now_ms();
        if (rc < 0 && errno != EINTR)
            lost = strerror(errno);
        while (rc > 0 && lost == NULL && in_flight) {
            if (sending) {
                ssize_t n = send(fd, req + req_off, req_len - req_off, 0);
                if (n < 0) {
                    if (errno != EAGAIN && errno != EINTR)
                        lost = strerror(errno);
                    break;
                }
                req_off += (size_t)n;
                if (req_off == req_len) {
                    sending = 0;
                    last_progress = now;
                }
                continue;
            }
            ssize_t n = recv(fd, rep + rep_len, sizeof rep - 1 - rep_len, 0);
            if (n == 0) {
                lost = "closed by peer";
                break;
            }
            if (n < 0) {
                if (errno != EAGAIN && errno != EINTR)
                    lost = strerror(errno);
                break;
            }
            rep_len += (size_t)n;
            last_progress = now;
            rep[rep_len] = '\0';
            char *nl = strchr(rep, '\n');
            if (nl == NULL) {
                if (rep_len == sizeof rep - 1)
                    lost = "reply line too long";
                continue;
            }
            if (nl != rep + rep_len - 1) {
                lost = "unexpected extra data from server";
                break;
            }
            *nl = '\0';

            /* A complete reply to the request in flight. */
            struct shadow *s = &sh[key];
            char want[64], got[64];
            int ok;
            uint64_t gotval = 0;
            if (is_set) {
                ok = strcmp(rep, "OK") == 0;
                if (ok) {
                    s->val = newval;
                    s->state = KNOWN;
                }
                snprintf(want, sizeof want, "OK");
                snprintf(got, sizeof got, "%.60s", rep);
            } else {
                int parsed = 1;
                if (strcmp(rep, "NONE") == 0)
                    gotval = 0;
                else if (strncmp(rep, "VALUE v", 7) != 0 || parse_u64(rep + 7, &gotval) != 0 || gotval == 0)
                    parsed = 0;
                ok = parsed && (s->state == UNKNOWN || gotval == s->val ||
                                (s->state == MAYBE && gotval == s->alt));
                if (s->state == MAYBE) {
                    char a[32], b[32];
                    fmt_val(a, sizeof a, s->val);
                    fmt_val(b, sizeof b, s->alt);
                    snprintf(want, sizeof want, "%s|%s", a, b);
                } else {
                    fmt_val(want, sizeof want, s->val);
                }
                if (parsed)
                    fmt_val(got, sizeof got, gotval);
                else
                    snprintf(got, sizeof got, "'%.50s'", rep);
                if (parsed) { /* adopt what the server has: count each divergence once */
                    s->val = gotval;
                    s->state = KNOWN;
                }
            }
            if (!ok) {
                errors++;
                if (mismatch_lines++ < MAX_MISMATCH_LINES)
                    printf("KVLOAD-MISMATCH key=%s.%" PRIu64 " op=%s expected=%s got=%s\n", prefix,
                           key, is_set ? "SET" : "GET", want, got);
            }
            ops++;
            total++;
            in_flight = 0;
        }
        if (lost == NULL && in_flight && now - last_progress > (int64_t)timeout * 1000)
            lost = "no reply within the timeout";
        if (lost != NULL) {
            if (in_flight && is_set && !sending) {
                /* The server may or may not have applied it. */
                struct shadow *s = &sh[key];
                if (s->state == KNOWN) {
                    s->alt = newval;
                    s->state = MAYBE;
                } else {
                    s->state = UNKNOWN;
                }
            } /* a partly sent line is never executed by the server */
            printf("kvload: t=%" PRId64 " conn=%" PRIu64 " lost: %s\n", (now - t0) / 1000, conn, lost);
            close(fd);
            fd = -1;
            in_flight = 0;
            next_connect = now + 1000;
        }
    }
}
