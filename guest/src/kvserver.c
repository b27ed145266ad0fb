/*
 * kvserver - a small in-memory key-value server over TCP.
 *
 *   kvserver PORT
 *
 * One process, many clients through poll(). Text protocol, one request per
 * line ('\n'-terminated), keys and values are tokens without spaces of at
 * most 250 bytes:
 *
 *   SET <key> <value>   ->  OK
 *   GET <key>           ->  VALUE <value>   or   NONE
 *   DEL <key>           ->  OK              or   NONE
 *   COUNT               ->  COUNT <number of keys>
 *   PING                ->  PONG
 *   anything else       ->  ERR <reason>
 *
 * Requests may be pipelined; replies come back in order.
 */
#include "common.h"

#define MAX_CLIENTS 256
#define MAX_TOKEN 250
#define IN_SIZE 2048  /* longest request line, plus slack */
#define OUT_SIZE 65536 /* replies waiting for the client to read them */
#define NBUCKETS 65536u

struct entry {
    struct entry *next;
    char *key;
    char *value;
};

static struct entry *buckets[NBUCKETS];
static uint64_t nkeys;

struct client {
    int fd;
    char in[IN_SIZE];
    size_t in_len;
    char out[OUT_SIZE];
    size_t out_off, out_len;
    char name[32];
};

static struct client *clients[MAX_CLIENTS];

static void usage(void)
{
    fprintf(stderr, "usage: kvserver PORT\n"
                    "  text protocol: SET k v | GET k | DEL k | COUNT | PING, one per line\n");
    exit(2);
}

static uint32_t hash(const char *s)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    while (*s)
        h = (h ^ (uint8_t)*s++) * 16777619u;
    return h % NBUCKETS;
}

static struct entry **lookup(const char *key)
{
    struct entry **pp = &buckets[hash(key)];
    while (*pp && strcmp((*pp)->key, key) != 0)
        pp = &(*pp)->next;
    return pp;
}

static void reply(struct client *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(c->out + c->out_len, OUT_SIZE - c->out_len, fmt, ap);
    va_end(ap);
    /* Callers check there is room for a reply (see handle_input). */
    if (n > 0)
        c->out_len += (size_t)n < OUT_SIZE - c->out_len ? (size_t)n : OUT_SIZE - c->out_len - 1;
}

static void handle_line(struct client *c, char *line)
{
    char *save = NULL;
    char *cmd = strtok_r(line, " \t\r", &save);
    char *key = strtok_r(NULL, " \t\r", &save);
    char *val = strtok_r(NULL, " \t\r", &save);
    char *extra = strtok_r(NULL, " \t\r", &save);

    if (cmd == NULL) {
        reply(c, "ERR empty request\n");
    } else if (strcmp(cmd, "PING") == 0) {
        reply(c, "PONG\n");
    } else if (strcmp(cmd, "COUNT") == 0) {
        reply(c, "COUNT %" PRIu64 "\n", nkeys);
    } else if (key == NULL || strlen(key) > MAX_TOKEN) {
        reply(c, "ERR missing or too long key\n");
    } else if (strcmp(cmd, "GET") == 0 && val == NULL) {
        struct entry *e = *lookup(key);
        if (e)
            reply(c, "VALUE %s\n", e->value);
        else
            reply(c, "NONE\n");
    } else if (strcmp(cmd, "DEL") == 0 && val == NULL) {
        struct entry **pp = lookup(key), *e = *pp;
        if (e) {
            *pp = e->next;
            free(e->key);
            free(e->value);
            free(e);
            nkeys--;
            reply(c, "OK\n");
        } else {
            reply(c, "NONE\n");
        }
    } else if (strcmp(cmd, "SET") == 0 && val != NULL && extra == NULL) {
        if (strlen(val) > MAX_TOKEN) {
            reply(c, "ERR value too long\n");
            return;
        }
        struct entry **pp = lookup(key), *e = *pp;
        char *v = strdup(val);
        if (v == NULL) {
            reply(c, "ERR out of memory\n");
            return;
        }
        if (e) {
            free(e->value);
            e->value = v;
        } else {
            e = malloc(sizeof *e);
            char *k = strdup(key);
            if (e == NULL || k == NULL) {
                free(e);
                free(k);
                free(v);
                reply(c, "ERR out of memory\n");
                return;
            }
            e->key = k;
            e->value = v;
            e->next = NULL;
            *pp = e;
            nkeys++;
        }
        reply(c, "OK\n");
    } else {
        reply(c, "ERR bad request\n");
    }
}

/* Execute complete lines while there is room for their replies. */
static int handle_input(struct client *c)
{
    size_t start = 0;
    for (;;) {
        if (OUT_SIZE - c->out_len < MAX_TOKEN + 64)
            break; /* client is not reading: stop until it does */
        char *nl = memchr(c->in + start, '\n', c->in_len - start);
        if (nl == NULL)
            break;
        *nl = '\0';
        handle_line(c, c->in + start);
        start = (size_t)(nl - c->in) + 1;
    }
    memmove(c->in, c->in + start, c->in_len - start);
    c->in_len -= start;
    if (c->in_len == IN_SIZE)
        return -1; /* a line longer than any valid request */
    return 0;
}

static void drop(int i, const char *why)
{
    struct client *c = clients[i];
    printf("kvserver: client %s closed (%s)\n", c->name, why);
    close(c->fd);
    free(c);
    clients[i] = NULL;
}

static int flush_out(struct client *c)
{
    while (c->out_off < c->out_len) {
        ssize_t n = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, 0);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR)
                break;
            return -1;
        }
        c->out_off += (size_t)n;
    }
    if (c->out_off == c->out_len)
        c->out_off = c->out_len = 0;
    else if (c->out_off > OUT_SIZE / 2) {
        memmove(c->out, c->out + c->out_off, c->out_len - c->out_off);
        c->out_len -= c->out_off;
        c->out_off = 0;
    }
    return 0;
}

int main(int argc, char **argv)
{
    uint16_t port;
    line_buffered();
    if (argc != 2 || parse_port(argv[1], &port) != 0)
        usage();
    int lfd = listen_tcp(port, "kvserver");
    set_nonblock(lfd, 1);
    printf("kvserver: listening on port %u\n", port);

    static struct pollfd pfd[MAX_CLIENTS + 1];
    static int idx[MAX_CLIENTS + 1];
    for (;;) {
        int n = 0;
        pfd[n].fd = lfd;
        pfd[n].events = POLLIN;
        idx[n++] = -1;
        for (int i = 0; i < MAX_CLIENTS; i++) {
            struct client *c = clients[i];
            if (c == NULL)
                continue;
            pfd[n].fd = c->fd;
            pfd[n].events = 0;
            if (c->out_len > c->out_off)
                pfd[n].events |= POLLOUT;
            if (c->in_len < IN_SIZE && OUT_SIZE - c->out_len >= MAX_TOKEN + 64)
                pfd[n].events |= POLLIN;
            idx[n++] = i;
        }
        if (poll(pfd, (nfds_t)n, -1) < 0) {
            if (errno != EINTR)
                sleep(1);
            continue;
        }

        if (pfd[0].revents & POLLIN) {
            struct sockaddr_in peer;
            socklen_t plen = sizeof peer;
            int fd;
            while ((fd = accept4(lfd, (struct sockaddr *)&peer, &plen, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0) {
                int slot = -1;
                for (int i = 0; i < MAX_CLIENTS && slot < 0; i++)
                    if (clients[i] == NULL)
                        slot = i;
                struct client *c = slot >= 0 ? malloc(sizeof *c) : NULL;
                if (c == NULL) {
                    printf("kvserver: too many clients, refusing one\n");
                    close(fd);
                    continue;
                }
                set_nodelay(fd);
                c->fd = fd;
                c->in_len = c->out_off = c->out_len = 0;
                char ip[INET_ADDRSTRLEN];
                inet_ntop(AF_INET, &peer.sin_addr, ip, sizeof ip);
                snprintf(c->name, sizeof c->name, "%s:%u", ip, ntohs(peer.sin_port));
                clients[slot] = c;
                printf("kvserver: client %s connected\n", c->name);
                plen = sizeof peer;
            }
        }

        for (int k = 1; k < n; k++) {
            int i = idx[k];
            struct client *c = clients[i];
            short re = pfd[k].revents;
            if (c == NULL || re == 0)
                continue;
            if (re & POLLIN) {
                ssize_t got = recv(c->fd, c->in + c->in_len, IN_SIZE - c->in_len, 0);
                if (got == 0) {
                    drop(i, "eof");
                    continue;
                }
                if (got < 0 && errno != EAGAIN && errno != EINTR) {
                    drop(i, strerror(errno));
                    continue;
                }
                if (got > 0)
                    c->in_len += (size_t)got;
            } else if (re & (POLLERR | POLLHUP)) {
                drop(i, "hangup");
                continue;
            }
            /* Flush first: room in the output lets queued requests run. */
            if (flush_out(c) != 0) {
                drop(i, strerror(errno));
                continue;
            }
            if (handle_input(c) != 0) {
                drop(i, "request line too long");
                continue;
            }
            if (flush_out(c) != 0) {
                drop(i, strerror(errno));
                continue;
            }
        }
    }
}
