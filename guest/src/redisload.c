/*
 * redisload - load generator and verifier for Redis, speaking RESP itself.
 *
 *   redisload IPV4 PORT [-k KEYS] [-r OPS_PER_SEC] [-i SECS] [-w WRITE_PCT]
 *                       [-P PREFIX] [-s VALUE_BYTES] [-t TIMEOUT_SECS] [-d SECS] [-K]
 *
 * One request at a time on one connection: a SET of a random key
 * PREFIX:<i> (i < KEYS, default 10000; PREFIX default "key") to the value
 * "<i>.<seq>.<filler>" (seq: this process's write sequence number, filler:
 * VALUE_BYTES in total, default 32, derived from i and seq), or a GET of a
 * random key it has written. WRITE_PCT (default 50) of the operations are
 * SETs; a GET chosen for a key never written becomes a SET. -r limits the
 * operations per second (default 0: as fast as the server answers).
 *
 * What a GET must return (the verification). Per key the client keeps
 *   acked:  seq of the last SET the server acknowledged (+OK), or the value
 *           a previous GET resolved to;
 *   doubt:  the SETs whose reply never came because the connection broke
 *           (sent, maybe applied, maybe not) since then; up to 4.
 * A GET must return the value of `acked` or of one of `doubt` (or nil when
 * nothing was acked yet). After a GET the key is resolved: acked becomes
 * what it returned and doubt is emptied. A newer acknowledged SET empties
 * doubt too: this assumes a request of a broken connection is not executed
 * after a request of a later connection (the client waits at least 100 ms
 * before it reconnects). A key with more than 4 SETs in doubt accepts
 * anything once. Anything else is corruption:
 *   REDISLOAD-CORRUPTION key=<k> want=<seq>[|<seq>...] got=<seq|nil|'raw'>
 * (at most 10 lines per interval), counted in errors=, after which the
 * client adopts the server's value so each divergence counts once.
 * An error reply (-ERR ...) also counts in errors= (REDISLOAD-ERROR line).
 *
 * Every interval (-i, default 1 s) on stdout, and with -K also in the
 * kernel log (/dev/kmsg, so it shows on the serial console):
 *   redisload: t=<s> sets=<n> gets=<n> acked=<n> errors=<n> reconnects=<n> conn=<id>
 * (totals since start; conn: number of the latest connection, 1 for the first;
 * reconnects: connections made after the first). On connection loss (EOF, error, no reply within -t, default
 * 10 s) it reconnects with a backoff of 100 ms doubling to 2 s.
 *
 * With -d SECS it stops after SECS seconds, GETs every key it wrote once
 * more (a full verification pass), prints a final line and exits 0 if
 * errors= is 0, 1 otherwise (also 1 when the pass could not finish within
 * twice the -t timeout). Without -d it runs until killed.
 */
#include "common.h"

#include <getopt.h>

#define MAX_DOUBT 4
#define MAX_CORRUPTION_LINES 10
#define MAX_VALUE 4096
#define MAX_PREFIX 64

enum { NONE = 0, KNOWN = 1, ANY = 2 };

struct key_state {
    uint64_t acked; /* seq; meaningful when state == KNOWN */
    uint64_t doubt[MAX_DOUBT];
    uint8_t ndoubt;
    uint8_t state;
};

static struct {
    uint64_t sets, gets, acked, errors, reconnects, conn;
} st;
static unsigned corruption_lines;
static int kmsg_fd = -1;
static char prefix[MAX_PREFIX + 1] = "key";
static size_t value_bytes = 32;

static void usage(void)
{
    fprintf(stderr,
            "usage: redisload HOST PORT [-k KEYS] [-r OPS_PER_SEC] [-i SECS] [-w WRITE_PCT]\n"
            "                 [-P PREFIX] [-s VALUE_BYTES] [-t TIMEOUT_SECS] [-d SECS] [-K]\n"
            "  -k KEYS      distinct keys PREFIX:0..KEYS-1 (default 10000)\n"
            "  -r OPS       operations per second, 0 = unlimited (default 0)\n"
            "  -i SECS      status line interval (default 1)\n"
            "  -w PCT       percentage of SETs (default 50)\n"
            "  -P PREFIX    key prefix (default key)\n"
            "  -s BYTES     value size, 24..4096 (default 32)\n"
            "  -t SECS      reconnect when no reply came for SECS (default 10)\n"
            "  -d SECS      stop after SECS, verify every key, exit 1 on any error\n"
            "  -V SECS      every SECS, read back every key written so far (full check)\n"
            "  -K           also write status lines to /dev/kmsg\n");
    exit(2);
}

/* The value of SET number seq of key i. */
static size_t make_value(char *buf, uint64_t i, uint64_t seq)
{
    int n = snprintf(buf, MAX_VALUE, "%" PRIu64 ".%" PRIu64 ".", i, seq);
    uint64_t x = (i * 0x9E3779B97F4A7C15ULL) ^ seq ^ 0x5bd1e995;
    if (x == 0)
        x = 1;
    size_t len = (size_t)n;
    while (len < value_bytes)
        buf[len++] = (char)('a' + rng_next(&x) % 26);
    buf[len] = '\0';
    return len;
}

/* The seq encoded in a value of key i, if it is exactly one of ours. */
static int parse_value(const char *v, size_t len, uint64_t i, uint64_t *seq)
{
    char want[MAX_VALUE + 1];
    const char *dot = memchr(v, '.', len);
    if (dot == NULL)
        return -1;
    const char *s = dot + 1;
    const char *dot2 = memchr(s, '.', len - (size_t)(s - v));
    if (dot2 == NULL || dot2 == s || (size_t)(dot2 - s) > 20)
        return -1;
    char num[24];
    memcpy(num, s, (size_t)(dot2 - s));
    num[dot2 - s] = '\0';
    uint64_t q;
    if (parse_u64(num, &q) != 0 || q == 0)
        return -1;
    if (make_value(want, i, q) != len || memcmp(want, v, len) != 0)
        return -1;
    *seq = q;
    return 0;
}

/* ------------------------------------------------------------ connection */

struct conn {
    int fd;
    char buf[2 * MAX_VALUE];
    size_t start, end;
};

static int fill(struct conn *c)
{
    if (c->start > 0) {
        memmove(c->buf, c->buf + c->start, c->end - c->start);
        c->end -= c->start;
        c->start = 0;
    }
    if (c->end == sizeof c->buf) {
        errno = EPROTO;
        return -1;
    }
    ssize_t n;
    do
        n = recv(c->fd, c->buf + c->end, sizeof c->buf - c->end, 0);
    while (n < 0 && errno == EINTR);
    if (n == 0) {
        errno = ECONNRESET;
        return -1;
    }
    if (n < 0)
        return -1;
    c->end += (size_t)n;
    return 0;
}

/* Next CRLF-terminated line (without CRLF), or NULL with errno set. */
static char *read_line(struct conn *c, size_t *len)
{
    for (;;) {
        char *p = c->buf + c->start;
        size_t avail = c->end - c->start;
        char *cr = avail > 1 ? memmem(p, avail, "\r\n", 2) : NULL;
        if (cr != NULL) {
            *cr = '\0';
            *len = (size_t)(cr - p);
            c->start += *len + 2;
            return p;
        }
        if (fill(c) != 0)
            return NULL;
    }
}

enum reply { REP_OK, REP_NIL, REP_BULK, REP_ERROR, REP_LOST };

/*
 * Reads one reply: +status, -error, $bulk or $-1. Bulk data goes to out
 * (NUL-terminated, *outlen); status and error text too. REP_LOST on a broken
 * connection or anything that is not RESP we expect.
 */
static enum reply read_reply(struct conn *c, char *out, size_t *outlen, const char **why)
{
    size_t len;
    char *line = read_line(c, &len);
    if (line == NULL) {
        *why = errno == EPROTO ? "reply too long" : strerror(errno);
        return REP_LOST;
    }
    if (line[0] == '+' || line[0] == '-') {
        snprintf(out, MAX_VALUE, "%s", line + 1);
        *outlen = strlen(out);
        return line[0] == '+' ? REP_OK : REP_ERROR;
    }
    if (line[0] != '$') {
        *why = "unexpected reply type";
        return REP_LOST;
    }
    if (strcmp(line, "$-1") == 0)
        return REP_NIL;
    uint64_t n;
    if (parse_u64(line + 1, &n) != 0 || n > MAX_VALUE) {
        *why = "bad bulk length";
        return REP_LOST;
    }
    while (c->end - c->start < n + 2)
        if (fill(c) != 0) {
            *why = strerror(errno);
            return REP_LOST;
        }
    char *p = c->buf + c->start;
    if (p[n] != '\r' || p[n + 1] != '\n') {
        *why = "bulk not followed by CRLF";
        return REP_LOST;
    }
    memcpy(out, p, n);
    out[n] = '\0';
    *outlen = n;
    c->start += n + 2;
    return REP_BULK;
}

/* Sends a command of 2 or 3 arguments as a RESP array. */
static int send_cmd(struct conn *c, const char *a, const char *b, const char *v, size_t vlen)
{
    char req[2 * MAX_VALUE + 256];
    int n;
    if (v == NULL)
        n = snprintf(req, sizeof req, "*2\r\n$%zu\r\n%s\r\n$%zu\r\n%s\r\n", strlen(a), a,
                     strlen(b), b);
    else
        n = snprintf(req, sizeof req, "*3\r\n$%zu\r\n%s\r\n$%zu\r\n%s\r\n$%zu\r\n%s\r\n",
                     strlen(a), a, strlen(b), b, vlen, v);
    return write_all(c->fd, req, (size_t)n);
}

/* ------------------------------------------------------------ reporting */

static void say(const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fputs(line, stdout);
    if (kmsg_fd >= 0) {
        ssize_t r = write(kmsg_fd, line, strlen(line));
        (void)r;
    }
}

static void fmt_seq(char *buf, size_t len, uint64_t seq)
{
    snprintf(buf, len, "%" PRIu64, seq);
}

static void status(int64_t t0)
{
    say("redisload: t=%" PRId64 " sets=%" PRIu64 " gets=%" PRIu64 " acked=%" PRIu64
        " errors=%" PRIu64 " reconnects=%" PRIu64 " conn=%" PRIu64 "\n",
        (now_ms() - t0) / 1000, st.sets, st.gets, st.acked, st.errors, st.reconnects, st.conn);
    corruption_lines = 0;
}

/* Checks a GET's answer for key i against what it may be; adopts it. */
static void check_get(struct key_state *k, uint64_t i, enum reply r, const char *v, size_t vlen)
{
    uint64_t seq = 0;
    int ours = r == REP_BULK && parse_value(v, vlen, i, &seq) == 0;
    int ok = k->state == ANY;
    if (!ok && r == REP_NIL)
        ok = k->state == NONE;
    if (!ok && ours) {
        ok = k->state == KNOWN && seq == k->acked;
        for (unsigned d = 0; d < k->ndoubt; d++)
            ok |= seq == k->doubt[d];
    }
    if (!ok) {
        st.errors++;
        if (corruption_lines++ < MAX_CORRUPTION_LINES) {
            char want[200] = "", got[80];
            size_t w = 0;
            if (k->state == KNOWN)
                w += (size_t)snprintf(want, sizeof want, "%" PRIu64, k->acked);
            else
                w += (size_t)snprintf(want, sizeof want, "nil");
            for (unsigned d = 0; d < k->ndoubt && w < sizeof want; d++)
                w += (size_t)snprintf(want + w, sizeof want - w, "|%" PRIu64, k->doubt[d]);
            if (r == REP_NIL)
                snprintf(got, sizeof got, "nil");
            else if (ours)
                fmt_seq(got, sizeof got, seq);
            else
                snprintf(got, sizeof got, "'%.60s'", v);
            say("REDISLOAD-CORRUPTION key=%s:%" PRIu64 " want=%s got=%s\n", prefix, i, want, got);
        }
    }
    /* Resolved: the server's value is the reference from now on. */
    k->ndoubt = 0;
    if (r == REP_NIL)
        k->state = NONE;
    else if (ours) {
        k->state = KNOWN;
        k->acked = seq;
    } else
        k->state = ANY; /* foreign value: accept whatever comes next */
}

int main(int argc, char **argv)
{
    uint64_t nkeys = 10000, rate = 0, interval = 1, write_pct = 50, timeout = 10, duration = 0, sweep_every = 0,
             vb = 32;
    int opt;

    line_buffered();
    while ((opt = getopt(argc, argv, "k:r:i:w:P:s:t:d:V:Kh")) != -1) {
        switch (opt) {
        case 'k':
            if (parse_u64(optarg, &nkeys) != 0 || nkeys == 0 || nkeys > 100000000)
                usage();
            break;
        case 'r':
            if (parse_u64(optarg, &rate) != 0 || rate > 10000000)
                usage();
            break;
        case 'i':
            if (parse_u64(optarg, &interval) != 0 || interval == 0 || interval > 86400)
                usage();
            break;
        case 'w':
            if (parse_u64(optarg, &write_pct) != 0 || write_pct > 100)
                usage();
            break;
        case 'P':
            if (strlen(optarg) == 0 || strlen(optarg) > MAX_PREFIX || strpbrk(optarg, " \t\r\n"))
                usage();
            strcpy(prefix, optarg);
            break;
        case 's':
            if (parse_u64(optarg, &vb) != 0 || vb < 24 || vb > MAX_VALUE - 1)
                usage();
            value_bytes = (size_t)vb;
            break;
        case 't':
            if (parse_u64(optarg, &timeout) != 0 || timeout == 0 || timeout > 3600)
                usage();
            break;
        case 'd':
            if (parse_u64(optarg, &duration) != 0 || duration == 0)
                usage();
            break;
        case 'V':
            if (parse_u64(optarg, &sweep_every) != 0 || sweep_every == 0 || sweep_every > 86400)
                usage();
            break;
        case 'K':
            kmsg_fd = open("/dev/kmsg", O_WRONLY | O_CLOEXEC);
            break;
        default:
            usage();
        }
    }
    if (argc - optind != 2)
        usage();
    const char *host = argv[optind];
    struct in_addr ip;
    uint16_t port;
    if (inet_pton(AF_INET, host, &ip) != 1) {
        fprintf(stderr, "redisload: '%s' is not an IPv4 address (no name resolution)\n", host);
        usage();
    }
    if (parse_port(argv[optind + 1], &port) != 0)
        usage();

    struct key_state *keys = calloc(nkeys, sizeof *keys);
    if (keys == NULL) {
        fprintf(stderr, "redisload: out of memory for %" PRIu64 " keys\n", nkeys);
        return 1;
    }
    say("redisload: server=%s:%u keys=%" PRIu64 " prefix=%s rate=%" PRIu64 " write_pct=%" PRIu64
        "\n", host, port, nkeys, prefix, rate, write_pct);

    uint64_t rng = rng_seed(), seq = 0, ops = 0;
    int64_t t0 = now_ms(), next_status = t0 + (int64_t)interval * 1000;
    int64_t end = duration ? t0 + (int64_t)duration * 1000 : INT64_MAX, backoff = 100;
    struct conn c = { .fd = -1 };
    char val[MAX_VALUE + 1], reply[MAX_VALUE + 1], keyname[MAX_PREFIX + 24];
    int verifying = 0, sweeping = 0;
    uint64_t verify_next = 0, sweep_errors = 0;
    int64_t next_sweep = sweep_every ? t0 + (int64_t)sweep_every * 1000 : INT64_MAX;

    for (;;) {
        int64_t now = now_ms();
        if (now >= next_status) {
            status(t0);
            next_status += (int64_t)interval * 1000;
            if (next_status <= now)
                next_status = now + (int64_t)interval * 1000;
        }
        if (!verifying && now >= end) {
            verifying = 1;
            say("redisload: t=%" PRId64 " verifying every written key\n", (now - t0) / 1000);
        }
        if (verifying && now > end + 2 * (int64_t)timeout * 1000) {
            status(t0);
            say("redisload: verification incomplete after %" PRIu64 " s (server unreachable?)\n",
                2 * timeout);
            return 1;
        }
        if (!verifying && !sweeping && now >= next_sweep) {
            /* A full check: every key written so far is read back (at full
             * speed), then the load goes on. */
            sweeping = 1;
            verify_next = 0;
            sweep_errors = st.errors;
        }
        if (sweeping) {
            while (verify_next < nkeys && keys[verify_next].state == NONE &&
                   keys[verify_next].ndoubt == 0)
                verify_next++;
            if (verify_next == nkeys) {
                uint64_t checked = 0;
                for (uint64_t j = 0; j < nkeys; j++)
                    checked += keys[j].state != NONE || keys[j].ndoubt != 0;
                say("redisload: t=%" PRId64 " full-check keys=%" PRIu64 " errors=%" PRIu64 "\n",
                    (now - t0) / 1000, checked, st.errors - sweep_errors);
                sweeping = 0;
                next_sweep = now_ms() + (int64_t)sweep_every * 1000;
                continue;
            }
        }
        if (verifying) {
            while (verify_next < nkeys && keys[verify_next].state == NONE &&
                   keys[verify_next].ndoubt == 0)
                verify_next++;
            if (verify_next == nkeys) {
                status(t0);
                say("redisload: done, errors=%" PRIu64 "\n", st.errors);
                return st.errors == 0 ? 0 : 1;
            }
        }
        if (c.fd < 0) {
            const char *err = "";
            c.fd = connect_tcp(&ip, port, 1000, &err);
            if (c.fd < 0) {
                say("redisload: connect to %s:%u failed: %s (retry in %" PRId64 " ms)\n", host, port,
                    err, backoff);
                poll(NULL, 0, (int)backoff);
                backoff = backoff * 2 > 2000 ? 2000 : backoff * 2;
                continue;
            }
            struct timeval tv = { .tv_sec = (time_t)timeout };
            setsockopt(c.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
            setsockopt(c.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
            c.start = c.end = 0;
            st.reconnects += st.conn > 0;
            st.conn++;
            say("redisload: t=%" PRId64 " conn=%" PRIu64 " connected\n", (now_ms() - t0) / 1000,
                st.conn);
        }
        if (rate > 0 && !verifying && !sweeping) {
            int64_t due = t0 + (int64_t)(ops * 1000 / rate);
            if (due > now) {
                int64_t wait = due < next_status ? due - now : next_status - now;
                poll(NULL, 0, (int)(wait > 0 ? wait : 0));
                continue;
            }
        }

        uint64_t i = verifying || sweeping ? verify_next : rng_next(&rng) % nkeys;
        struct key_state *k = &keys[i];
        int is_set = !verifying && !sweeping && ((rng_next(&rng) >> 11) % 100 < write_pct ||
                                    (k->state == NONE && k->ndoubt == 0));
        snprintf(keyname, sizeof keyname, "%s:%" PRIu64, prefix, i);
        const char *why = NULL;
        enum reply r = REP_LOST;
        size_t rlen = 0;
        uint64_t s = 0;
        if (is_set) {
            s = ++seq;
            size_t vlen = make_value(val, i, s);
            st.sets++;
            if (send_cmd(&c, "SET", keyname, val, vlen) != 0)
                why = strerror(errno);
        } else if (send_cmd(&c, "GET", keyname, NULL, 0) != 0) {
            why = strerror(errno);
        }
        if (why == NULL)
            r = read_reply(&c, reply, &rlen, &why);
        ops++;
        if (r == REP_LOST) {
            if (is_set) { /* sent (maybe in part): applied or not, we cannot know */
                if (k->ndoubt < MAX_DOUBT)
                    k->doubt[k->ndoubt++] = s;
                else
                    k->state = ANY;
            }
            say("redisload: t=%" PRId64 " conn=%" PRIu64 " lost: %s\n", (now_ms() - t0) / 1000,
                st.conn, why);
            close(c.fd);
            c.fd = -1;
            poll(NULL, 0, (int)backoff);
            backoff = backoff * 2 > 2000 ? 2000 : backoff * 2;
            continue;
        }
        backoff = 100;
        if (r == REP_ERROR || (is_set && r != REP_OK)) {
            st.errors++;
            if (corruption_lines++ < MAX_CORRUPTION_LINES)
                say("REDISLOAD-ERROR key=%s op=%s reply='%.100s'\n", keyname, is_set ? "SET" : "GET",
                    r == REP_ERROR || r == REP_OK ? reply : "(not a status)");
            continue;
        }
        if (is_set) {
            st.acked++;
            k->state = KNOWN;
            k->acked = s;
            k->ndoubt = 0;
        } else {
            st.gets++;
            check_get(k, i, r, reply, rlen);
            if (verifying || sweeping)
                verify_next++;
        }
    }
}
