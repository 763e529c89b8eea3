/*
 * A stand-in for Ascend's libdcmi.so on simulated Ascend nodes: the DCMI calls the agent makes,
 * answered from a data file kept next to the library (this library's resolved path with ".data"
 * appended, found with dladdr). The file is re-read whenever the card list is asked for, so the
 * simulator injects a fault by rewriting it.
 *
 * One line per chip, fields separated by tabs (written by edl_agent/sim/ascend_dcmi.py):
 *   chip  card=<id>  device=<id in card>  logic=<logic id>  phy=<phy id, N of /dev/davinci<N>>
 *         name=<chip name>  type=<chip type>  ver=<chip version>  aicore=<count>
 *         domain=<n>  bus=<n>  slot=<n>  func=<n>  health=<0..3>  codes=<hex,hex,...>
 *         hbm_mb=<MB, 0: no HBM>  hbm_used_mb=<MB>  ddr_mb=<MB>  ddr_util=<percent>
 *         temp=<C>  power_dw=<tenths of a W>  aicore_util=<percent>
 *         ip=<the RoCE port's IPv4 address, empty: none>
 *
 * Fault events come from an append-only file next to the library (".events" appended), one per
 * line:
 *   event  logic=<logic id>  id=<hex event id>  severity=<0..3>  assertion=<0|1|2>  name=<text>
 * dcmi_subscribe_fault_event starts one thread that delivers the lines written since the first
 * subscription to the handler, as the real library calls its handler from a thread of its own.
 * The thread sleeps until the library's directory changes (inotify; a 1 s timeout, or a 2 ms poll
 * where inotify is unavailable) and ends when the data file is gone, so that a finished test's
 * subscription costs nothing.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define DCMI_OK 0
#define DCMI_ERR_INVALID_PARAMETER (-8001)
#define DCMI_ERR_INNER (-8005)
#define DCMI_ERR_INVALID_DEVICE_ID (-8007)
#define DCMI_ERR_NOT_SUPPORT (-8255)

#define MAX_CHIP_NAME_LEN 32
#define MAX_CHIPS 64
#define MAX_CODES 16
#define EVENT_NAME_LENGTH 256
#define EVENT_DATA_LENGTH 32
#define EVENT_RESV_LENGTH 32
#define UTIL_AICORE 2

struct dcmi_chip_info {
    unsigned char chip_type[MAX_CHIP_NAME_LEN];
    unsigned char chip_name[MAX_CHIP_NAME_LEN];
    unsigned char chip_ver[MAX_CHIP_NAME_LEN];
    unsigned int aicore_cnt;
};

struct dcmi_pcie_info_all {
    unsigned int venderid;
    unsigned int subvenderid;
    unsigned int deviceid;
    unsigned int subdeviceid;
    int domain;
    unsigned int bdf_busid;
    unsigned int bdf_deviceid;
    unsigned int bdf_funcid;
    unsigned char reserve[32];
};

struct dcmi_hbm_info {
    unsigned long long memory_size;
    unsigned int freq;
    unsigned long long memory_usage;
    int temp;
    unsigned int bandwith_util_rate;
};

struct dcmi_get_memory_info_stru {
    unsigned long long memory_size;
    unsigned long long memory_available;
    unsigned int freq;
    unsigned long hugepagesize;
    unsigned long hugepages_total;
    unsigned long hugepages_free;
    unsigned int utiliza;
    unsigned char reserve[60];
};

struct dcmi_dms_fault_event {
    unsigned int event_id;
    unsigned short deviceid;
    unsigned char node_type;
    unsigned char node_id;
    unsigned char sub_node_type;
    unsigned char sub_node_id;
    unsigned char severity;
    unsigned char assertion;
    int event_serial_num;
    int notify_serial_num;
    unsigned long long alarm_raised_time;
    char event_name[EVENT_NAME_LENGTH];
    char additional_info[EVENT_DATA_LENGTH];
    unsigned char resv[EVENT_RESV_LENGTH];
};

struct dcmi_event {
    int type; /* DCMI_DMS_FAULT_EVENT = 0 */
    union {
        struct dcmi_dms_fault_event dms_event;
    } event_t;
};

struct dcmi_event_filter {
    unsigned long long filter_flag;
    unsigned int event_id;
    unsigned char severity;
    unsigned char node_type;
    unsigned char resv[EVENT_RESV_LENGTH];
};

struct dcmi_ip_addr {
    union {
        unsigned char ip6[16];
        unsigned char ip4[4];
    } u_addr;
    int ip_type; /* 0 IPv4, 1 IPv6 */
};

#define DCMI_ROCE_PORT 1

typedef void (*fault_handler)(struct dcmi_event *);

struct chip {
    int card, device, logic, phy;
    char name[MAX_CHIP_NAME_LEN], type[MAX_CHIP_NAME_LEN], ver[MAX_CHIP_NAME_LEN];
    unsigned int aicore;
    int domain;
    unsigned int bus, slot, func;
    unsigned int health;
    unsigned int codes[MAX_CODES];
    int code_count;
    unsigned long long hbm_mb, hbm_used_mb, ddr_mb;
    unsigned int ddr_util;
    int temp, power_dw;
    unsigned int aicore_util;
    unsigned char ip[4];
    int has_ip;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct chip chips[MAX_CHIPS];
static int chip_count;
static int initialised;
static fault_handler handler;
static pthread_t event_thread;
static int event_thread_started;
static long events_offset;
static int serial;

static int sibling(const char *suffix, char *out, size_t size)
{
    Dl_info info;
    char resolved[PATH_MAX];
    if (dladdr((void *)&sibling, &info) == 0 || info.dli_fname == NULL ||
        realpath(info.dli_fname, resolved) == NULL)
        return -1;
    return (size_t)snprintf(out, size, "%s%s", resolved, suffix) < size ? 0 : -1;
}

static void copy_text(char *out, size_t size, const char *value)
{
    snprintf(out, size, "%s", value);
}

static void read_codes(struct chip *c, const char *value)
{
    char text[256];
    char *save = NULL;
    copy_text(text, sizeof text, value);
    c->code_count = 0;
    for (char *code = strtok_r(text, ",", &save); code != NULL && c->code_count < MAX_CODES;
         code = strtok_r(NULL, ",", &save))
        c->codes[c->code_count++] = (unsigned int)strtoul(code, NULL, 16);
}

static void read_field(struct chip *c, const char *field)
{
    const char *eq = strchr(field, '=');
    char key[32];
    if (eq == NULL || (size_t)(eq - field) >= sizeof key)
        return;
    memcpy(key, field, (size_t)(eq - field));
    key[eq - field] = '\0';
    const char *value = eq + 1;
    long long number = strtoll(value, NULL, 10);
    if (strcmp(key, "card") == 0) c->card = (int)number;
    else if (strcmp(key, "device") == 0) c->device = (int)number;
    else if (strcmp(key, "logic") == 0) c->logic = (int)number;
    else if (strcmp(key, "phy") == 0) c->phy = (int)number;
    else if (strcmp(key, "name") == 0) copy_text(c->name, sizeof c->name, value);
    else if (strcmp(key, "type") == 0) copy_text(c->type, sizeof c->type, value);
    else if (strcmp(key, "ver") == 0) copy_text(c->ver, sizeof c->ver, value);
    else if (strcmp(key, "aicore") == 0) c->aicore = (unsigned int)number;
    else if (strcmp(key, "domain") == 0) c->domain = (int)number;
    else if (strcmp(key, "bus") == 0) c->bus = (unsigned int)number;
    else if (strcmp(key, "slot") == 0) c->slot = (unsigned int)number;
    else if (strcmp(key, "func") == 0) c->func = (unsigned int)number;
    else if (strcmp(key, "health") == 0) c->health = (unsigned int)number;
    else if (strcmp(key, "codes") == 0) read_codes(c, value);
    else if (strcmp(key, "hbm_mb") == 0) c->hbm_mb = (unsigned long long)number;
    else if (strcmp(key, "hbm_used_mb") == 0) c->hbm_used_mb = (unsigned long long)number;
    else if (strcmp(key, "ddr_mb") == 0) c->ddr_mb = (unsigned long long)number;
    else if (strcmp(key, "ddr_util") == 0) c->ddr_util = (unsigned int)number;
    else if (strcmp(key, "temp") == 0) c->temp = (int)number;
    else if (strcmp(key, "power_dw") == 0) c->power_dw = (int)number;
    else if (strcmp(key, "aicore_util") == 0) c->aicore_util = (unsigned int)number;
    else if (strcmp(key, "ip") == 0) {
        unsigned int a, b, d, e;
        c->has_ip = sscanf(value, "%u.%u.%u.%u", &a, &b, &d, &e) == 4;
        c->ip[0] = (unsigned char)a; c->ip[1] = (unsigned char)b;
        c->ip[2] = (unsigned char)d; c->ip[3] = (unsigned char)e;
    }
}

/* Caller holds the lock. */
static int load(void)
{
    char path[PATH_MAX + 8];
    char line[2048];
    FILE *file;
    if (sibling(".data", path, sizeof path) != 0 || (file = fopen(path, "r")) == NULL)
        return DCMI_ERR_INNER;
    chip_count = 0;
    while (fgets(line, sizeof line, file) != NULL && chip_count < MAX_CHIPS) {
        char *save = NULL;
        char *field = strtok_r(line, "\t\n", &save);
        if (field == NULL || strcmp(field, "chip") != 0)
            continue;
        struct chip *c = &chips[chip_count++];
        memset(c, 0, sizeof *c);
        while ((field = strtok_r(NULL, "\t\n", &save)) != NULL)
            read_field(c, field);
    }
    fclose(file);
    return DCMI_OK;
}

int dcmi_init(void)
{
    pthread_mutex_lock(&lock);
    int status = load();
    if (status == DCMI_OK)
        initialised = 1;
    pthread_mutex_unlock(&lock);
    return status;
}

int dcmi_get_dcmi_version(char *dcmi_ver, int buf_size)
{
    if (dcmi_ver == NULL || buf_size <= 0)
        return DCMI_ERR_INVALID_PARAMETER;
    snprintf(dcmi_ver, (size_t)buf_size, "%s", "7.0.0-simulated");
    return DCMI_OK;
}

int dcmi_get_card_list(int *card_num, int *card_list, int list_len)
{
    if (card_num == NULL || card_list == NULL || list_len <= 0)
        return DCMI_ERR_INVALID_PARAMETER;
    pthread_mutex_lock(&lock);
    int status = initialised ? load() : DCMI_ERR_INNER;
    int found = 0;
    for (int i = 0; status == DCMI_OK && i < chip_count; i++) {
        int seen = 0;
        for (int j = 0; j < found; j++)
            seen |= card_list[j] == chips[i].card;
        if (!seen && found < list_len)
            card_list[found++] = chips[i].card;
    }
    if (status == DCMI_OK)
        *card_num = found;
    pthread_mutex_unlock(&lock);
    return status;
}

int dcmi_get_device_num_in_card(int card_id, int *device_num)
{
    if (device_num == NULL)
        return DCMI_ERR_INVALID_PARAMETER;
    pthread_mutex_lock(&lock);
    int count = 0;
    for (int i = 0; i < chip_count; i++)
        count += chips[i].card == card_id;
    pthread_mutex_unlock(&lock);
    if (count == 0)
        return DCMI_ERR_INVALID_DEVICE_ID;
    *device_num = count;
    return DCMI_OK;
}

/* A copy of the chip at (card, device), or an error. */
static int get(int card_id, int device_id, struct chip *out)
{
    int status = DCMI_ERR_INVALID_DEVICE_ID;
    pthread_mutex_lock(&lock);
    for (int i = 0; initialised && i < chip_count; i++) {
        if (chips[i].card == card_id && chips[i].device == device_id) {
            *out = chips[i];
            status = DCMI_OK;
            break;
        }
    }
    if (!initialised)
        status = DCMI_ERR_INNER;
    pthread_mutex_unlock(&lock);
    return status;
}

int dcmi_get_device_logic_id(int *device_logic_id, int card_id, int device_id)
{
    struct chip c;
    int status = device_logic_id == NULL ? DCMI_ERR_INVALID_PARAMETER : get(card_id, device_id, &c);
    if (status == DCMI_OK)
        *device_logic_id = c.logic;
    return status;
}

int dcmi_get_device_phyid_from_logicid(unsigned int logicid, unsigned int *phyid)
{
    int status = DCMI_ERR_INVALID_DEVICE_ID;
    if (phyid == NULL)
        return DCMI_ERR_INVALID_PARAMETER;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < chip_count; i++) {
        if ((unsigned int)chips[i].logic == logicid) {
            *phyid = (unsigned int)chips[i].phy;
            status = DCMI_OK;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int dcmi_get_device_chip_info(int card_id, int device_id, struct dcmi_chip_info *chip_info)
{
    struct chip c;
    int status = chip_info == NULL ? DCMI_ERR_INVALID_PARAMETER : get(card_id, device_id, &c);
    if (status != DCMI_OK)
        return status;
    memset(chip_info, 0, sizeof *chip_info);
    memcpy(chip_info->chip_type, c.type, strnlen(c.type, MAX_CHIP_NAME_LEN - 1));
    memcpy(chip_info->chip_name, c.name, strnlen(c.name, MAX_CHIP_NAME_LEN - 1));
    memcpy(chip_info->chip_ver, c.ver, strnlen(c.ver, MAX_CHIP_NAME_LEN - 1));
    chip_info->aicore_cnt = c.aicore;
    return DCMI_OK;
}

int dcmi_get_device_pcie_info_v2(int card_id, int device_id, struct dcmi_pcie_info_all *pcie_info)
{
    struct chip c;
    int status = pcie_info == NULL ? DCMI_ERR_INVALID_PARAMETER : get(card_id, device_id, &c);
    if (status != DCMI_OK)
        return status;
    memset(pcie_info, 0, sizeof *pcie_info);
    pcie_info->venderid = 0x19e5;
    pcie_info->deviceid = 0xd802;
    pcie_info->domain = c.domain;
    pcie_info->bdf_busid = c.bus;
    pcie_info->bdf_deviceid = c.slot;
    pcie_info->bdf_funcid = c.func;
    return DCMI_OK;
}

int dcmi_get_device_health(int card_id, int device_id, unsigned int *health)
{
    struct chip c;
    int status = health == NULL ? DCMI_ERR_INVALID_PARAMETER : get(card_id, device_id, &c);
    if (status == DCMI_OK)
        *health = c.health;
    return status;
}

int dcmi_get_device_errorcode_v2(int card_id, int device_id, int *error_count,
                                 unsigned int *error_code_list, unsigned int list_len)
{
    struct chip c;
    if (error_count == NULL || error_code_list == NULL)
        return DCMI_ERR_INVALID_PARAMETER;
    int status = get(card_id, device_id, &c);
    if (status != DCMI_OK)
        return status;
    int count = c.code_count < (int)list_len ? c.code_count : (int)list_len;
    for (int i = 0; i < count; i++)
        error_code_list[i] = c.codes[i];
    *error_count = count;
    return DCMI_OK;
}

int dcmi_get_device_temperature(int card_id, int device_id, int *temperature)
{
    struct chip c;
    int status = temperature == NULL ? DCMI_ERR_INVALID_PARAMETER : get(card_id, device_id, &c);
    if (status == DCMI_OK)
        *temperature = c.temp;
    return status;
}

int dcmi_get_device_power_info(int card_id, int device_id, int *power)
{
    struct chip c;
    int status = power == NULL ? DCMI_ERR_INVALID_PARAMETER : get(card_id, device_id, &c);
    if (status == DCMI_OK)
        *power = c.power_dw;
    return status;
}

int dcmi_get_device_utilization_rate(int card_id, int device_id, int input_type,
                                     unsigned int *utilization_rate)
{
    struct chip c;
    int status = utilization_rate == NULL ? DCMI_ERR_INVALID_PARAMETER
                                          : get(card_id, device_id, &c);
    if (status == DCMI_OK && input_type != UTIL_AICORE)
        return DCMI_ERR_NOT_SUPPORT;
    if (status == DCMI_OK)
        *utilization_rate = c.aicore_util;
    return status;
}

int dcmi_get_device_hbm_info(int card_id, int device_id, struct dcmi_hbm_info *hbm_info)
{
    struct chip c;
    int status = hbm_info == NULL ? DCMI_ERR_INVALID_PARAMETER : get(card_id, device_id, &c);
    if (status != DCMI_OK)
        return status;
    if (c.hbm_mb == 0)
        return DCMI_ERR_NOT_SUPPORT;
    memset(hbm_info, 0, sizeof *hbm_info);
    hbm_info->memory_size = c.hbm_mb;
    hbm_info->memory_usage = c.hbm_used_mb;
    hbm_info->temp = c.temp;
    return DCMI_OK;
}

int dcmi_get_device_memory_info_v3(int card_id, int device_id,
                                   struct dcmi_get_memory_info_stru *memory_info)
{
    struct chip c;
    int status = memory_info == NULL ? DCMI_ERR_INVALID_PARAMETER : get(card_id, device_id, &c);
    if (status != DCMI_OK)
        return status;
    if (c.ddr_mb == 0)
        return DCMI_ERR_NOT_SUPPORT;
    memset(memory_info, 0, sizeof *memory_info);
    memory_info->memory_size = c.ddr_mb;
    memory_info->memory_available = c.ddr_mb - c.ddr_mb * c.ddr_util / 100;
    memory_info->utiliza = c.ddr_util;
    return DCMI_OK;
}

int dcmi_get_device_ip(int card_id, int device_id, int input_type, int port_id,
                       struct dcmi_ip_addr *ip, struct dcmi_ip_addr *mask)
{
    struct chip c;
    if (ip == NULL || mask == NULL || input_type != DCMI_ROCE_PORT || port_id != 0)
        return DCMI_ERR_INVALID_PARAMETER;
    int status = get(card_id, device_id, &c);
    if (status != DCMI_OK)
        return status;
    if (!c.has_ip || ip->ip_type != 0)
        return DCMI_ERR_NOT_SUPPORT;
    memcpy(ip->u_addr.ip4, c.ip, 4);
    memset(mask, 0, sizeof *mask);
    memset(mask->u_addr.ip4, 255, 3);
    return DCMI_OK;
}

/* ---- Fault events ------------------------------------------------------------------------- */

static long file_size(const char *suffix)
{
    char path[PATH_MAX + 8];
    struct stat info;
    if (sibling(suffix, path, sizeof path) != 0 || stat(path, &info) != 0)
        return -1;
    return (long)info.st_size;
}

/* One event line into `out`; 1 when it is one. */
static int parse_event(char *line, struct dcmi_event *out)
{
    char *save = NULL;
    char *field = strtok_r(line, "\t\n", &save);
    if (field == NULL || strcmp(field, "event") != 0)
        return 0;
    memset(out, 0, sizeof *out);
    struct dcmi_dms_fault_event *event = &out->event_t.dms_event;
    while ((field = strtok_r(NULL, "\t\n", &save)) != NULL) {
        if (strncmp(field, "logic=", 6) == 0)
            event->deviceid = (unsigned short)strtoul(field + 6, NULL, 10);
        else if (strncmp(field, "id=", 3) == 0)
            event->event_id = (unsigned int)strtoul(field + 3, NULL, 16);
        else if (strncmp(field, "severity=", 9) == 0)
            event->severity = (unsigned char)strtoul(field + 9, NULL, 10);
        else if (strncmp(field, "assertion=", 10) == 0)
            event->assertion = (unsigned char)strtoul(field + 10, NULL, 10);
        else if (strncmp(field, "name=", 5) == 0)
            copy_text(event->event_name, sizeof event->event_name, field + 5);
    }
    event->event_serial_num = ++serial;
    event->notify_serial_num = serial;
    event->alarm_raised_time = (unsigned long long)time(NULL);
    return 1;
}

/* Delivers the complete lines written since the last call; consumes only what it read. */
static void deliver(fault_handler to)
{
    char path[PATH_MAX + 8];
    char line[512];
    struct dcmi_event event;
    FILE *file;
    if (sibling(".events", path, sizeof path) != 0 || (file = fopen(path, "r")) == NULL)
        return;
    if (fseek(file, events_offset, SEEK_SET) == 0) {
        while (fgets(line, sizeof line, file) != NULL) {
            size_t length = strlen(line);
            if (length == 0 || line[length - 1] != '\n')
                break; /* a line still being written: read it next time */
            events_offset += (long)length;
            if (parse_event(line, &event))
                to(&event);
        }
    }
    fclose(file);
}

/* An inotify descriptor watching the library's directory, or -1. */
static int watch_directory(void)
{
    char path[PATH_MAX + 8];
    int fd;
    if (sibling(".events", path, sizeof path) != 0 || strrchr(path, '/') == NULL)
        return -1;
    *strrchr(path, '/') = '\0';
    if ((fd = inotify_init1(IN_CLOEXEC)) < 0)
        return -1;
    if (inotify_add_watch(fd, path, IN_MODIFY | IN_CLOSE_WRITE | IN_CREATE | IN_MOVED_TO |
                                        IN_DELETE | IN_DELETE_SELF) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static void *event_loop(void *unused)
{
    struct timespec step = {0, 2 * 1000 * 1000};
    char changes[4096];
    int fd = watch_directory();
    (void)unused;
    while (file_size(".data") >= 0) {
        pthread_mutex_lock(&lock);
        fault_handler to = handler;
        pthread_mutex_unlock(&lock);
        if (to != NULL)
            deliver(to);
        if (fd < 0) {
            nanosleep(&step, NULL);
            continue;
        }
        struct pollfd ready = {fd, POLLIN, 0};
        if (poll(&ready, 1, 1000) > 0 && read(fd, changes, sizeof changes) < 0)
            break;
    }
    if (fd >= 0)
        close(fd);
    return NULL;
}

int dcmi_subscribe_fault_event(int card_id, int device_id, struct dcmi_event_filter filter,
                               fault_handler on_event)
{
    (void)filter;
    if (on_event == NULL || (card_id != -1 && device_id == -1))
        return DCMI_ERR_INVALID_PARAMETER;
    pthread_mutex_lock(&lock);
    int status = initialised ? DCMI_OK : DCMI_ERR_INNER;
    if (status == DCMI_OK) {
        handler = on_event;
        if (!event_thread_started) {
            long size = file_size(".events");
            events_offset = size > 0 ? size : 0;
            if (pthread_create(&event_thread, NULL, event_loop, NULL) == 0) {
                pthread_detach(event_thread);
                event_thread_started = 1;
            } else {
                status = DCMI_ERR_INNER;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    return status;
}
