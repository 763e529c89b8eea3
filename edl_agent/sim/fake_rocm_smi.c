/*
 * A stand-in for DTK's librocm_smi64.so on simulated Hygon nodes: the few rocm_smi calls the
 * agent makes, answered from a data file kept next to the library (this library's resolved path
 * with ".data" appended, found with dladdr). The file is re-read whenever the device count is
 * asked for, so the simulator injects a fault by rewriting it.
 *
 * One line per device, fields separated by tabs (written by edl_agent/sim/hygon_tree.py):
 *   dcu  bdfid=<u64>  temp_mc=<i64>  temp_max_mc=<i64>  power_uw=<u64>  busy=<u32>
 *        vram_total=<bytes>  vram_used=<bytes>  ecc_ce=<u64>  ecc_ue=<u64>  gone=<0|1>
 * A device with gone=1 answers its PCI id and fails every other read with
 * RSMI_STATUS_UNKNOWN_ERROR, what rocm_smi makes of the ENODEV its sysfs reads then fail with. ECC counts belong to the UMC block; the
 * other blocks count nothing.
 *
 * Events come from an append-only file next to the library (".events" appended), one per line:
 *   event  dcu=<index>  kind=<rsmi_evt_notification_type_t>  message=<text>
 * rsmi_event_notification_get delivers the lines written since the first
 * rsmi_event_notification_init, for devices whose mask has that kind, and waits (polling the
 * file) up to its timeout for one.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

typedef enum {
    RSMI_STATUS_SUCCESS = 0,
    RSMI_STATUS_INVALID_ARGS = 1,
    RSMI_STATUS_NOT_SUPPORTED = 2,
    RSMI_STATUS_FILE_ERROR = 3,
    RSMI_STATUS_INIT_ERROR = 8,
    RSMI_STATUS_NO_DATA = 14,
    RSMI_STATUS_UNKNOWN_ERROR = 0xFFFFFFFF,
} rsmi_status_t;

#define MESSAGE_SIZE 64

typedef struct {
    uint32_t dv_ind;
    int32_t event;
    char message[MESSAGE_SIZE];
} rsmi_evt_notification_data_t;

typedef struct {
    uint64_t correctable_err;
    uint64_t uncorrectable_err;
} rsmi_error_count_t;

#define MAX_DEVICES 64
#define TEMP_TYPE_EDGE 0
#define TEMP_TYPE_JUNCTION 1
#define TEMP_CURRENT 0
#define TEMP_MAX 1
#define MEM_TYPE_VRAM 0
#define BLOCK_UMC 0x1ULL

struct device {
    uint64_t bdfid;
    int64_t temp_mc;
    int64_t temp_max_mc;
    uint64_t power_uw;
    uint32_t busy;
    uint64_t vram_total;
    uint64_t vram_used;
    uint64_t ecc_ce;
    uint64_t ecc_ue;
    int gone;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct device devices[MAX_DEVICES];
static uint32_t device_count;
static int init_count;
static uint64_t event_masks[MAX_DEVICES];
static int event_started[MAX_DEVICES];
static int events_open;  /* devices started and not stopped */
static long events_offset;

static int sibling(const char *suffix, char *out, size_t size)
{
    Dl_info info;
    char resolved[PATH_MAX];
    if (dladdr((void *)&sibling, &info) == 0 || info.dli_fname == NULL ||
        realpath(info.dli_fname, resolved) == NULL)
        return -1;
    return (size_t)snprintf(out, size, "%s%s", resolved, suffix) < size ? 0 : -1;
}

static void read_field(struct device *dev, const char *field)
{
    char key[32];
    unsigned long long value;
    long long signed_value;
    if (sscanf(field, "%31[^=]=%lld", key, &signed_value) == 2 &&
        (strcmp(key, "temp_mc") == 0 || strcmp(key, "temp_max_mc") == 0)) {
        if (strcmp(key, "temp_mc") == 0)
            dev->temp_mc = signed_value;
        else
            dev->temp_max_mc = signed_value;
        return;
    }
    if (sscanf(field, "%31[^=]=%llu", key, &value) != 2)
        return;
    if (strcmp(key, "bdfid") == 0)
        dev->bdfid = value;
    else if (strcmp(key, "power_uw") == 0)
        dev->power_uw = value;
    else if (strcmp(key, "busy") == 0)
        dev->busy = (uint32_t)value;
    else if (strcmp(key, "vram_total") == 0)
        dev->vram_total = value;
    else if (strcmp(key, "vram_used") == 0)
        dev->vram_used = value;
    else if (strcmp(key, "ecc_ce") == 0)
        dev->ecc_ce = value;
    else if (strcmp(key, "ecc_ue") == 0)
        dev->ecc_ue = value;
    else if (strcmp(key, "gone") == 0)
        dev->gone = value != 0;
}

/* Caller holds the lock. */
static rsmi_status_t load(void)
{
    char path[PATH_MAX + 8];
    char line[1024];
    FILE *file;
    if (sibling(".data", path, sizeof path) != 0 || (file = fopen(path, "r")) == NULL)
        return RSMI_STATUS_INIT_ERROR;
    device_count = 0;
    while (fgets(line, sizeof line, file) != NULL && device_count < MAX_DEVICES) {
        char *save = NULL;
        char *field = strtok_r(line, "\t\n", &save);
        if (field == NULL || strcmp(field, "dcu") != 0)
            continue;
        struct device *dev = &devices[device_count++];
        memset(dev, 0, sizeof *dev);
        while ((field = strtok_r(NULL, "\t\n", &save)) != NULL)
            read_field(dev, field);
    }
    fclose(file);
    return RSMI_STATUS_SUCCESS;
}

rsmi_status_t rsmi_init(uint64_t flags)
{
    (void)flags;
    pthread_mutex_lock(&lock);
    rsmi_status_t status = load();
    if (status == RSMI_STATUS_SUCCESS)
        init_count++;
    pthread_mutex_unlock(&lock);
    return status;
}

rsmi_status_t rsmi_shut_down(void)
{
    pthread_mutex_lock(&lock);
    if (init_count > 0)
        init_count--;
    pthread_mutex_unlock(&lock);
    return RSMI_STATUS_SUCCESS;
}

rsmi_status_t rsmi_num_monitor_devices(uint32_t *num_devices)
{
    if (num_devices == NULL)
        return RSMI_STATUS_INVALID_ARGS;
    pthread_mutex_lock(&lock);
    rsmi_status_t status = init_count > 0 ? load() : RSMI_STATUS_INIT_ERROR;
    if (status == RSMI_STATUS_SUCCESS)
        *num_devices = device_count;
    pthread_mutex_unlock(&lock);
    return status;
}

/* A copy of device `index`, or an error status. */
static rsmi_status_t get(uint32_t index, struct device *out, int allow_gone)
{
    rsmi_status_t status = RSMI_STATUS_SUCCESS;
    pthread_mutex_lock(&lock);
    if (init_count == 0)
        status = RSMI_STATUS_INIT_ERROR;
    else if (index >= device_count)
        status = RSMI_STATUS_INVALID_ARGS;
    else if (devices[index].gone && !allow_gone)
        status = RSMI_STATUS_UNKNOWN_ERROR;
    else
        *out = devices[index];
    pthread_mutex_unlock(&lock);
    return status;
}

rsmi_status_t rsmi_dev_pci_id_get(uint32_t dv_ind, uint64_t *bdfid)
{
    struct device dev;
    rsmi_status_t status = bdfid == NULL ? RSMI_STATUS_INVALID_ARGS : get(dv_ind, &dev, 1);
    if (status == RSMI_STATUS_SUCCESS)
        *bdfid = dev.bdfid;
    return status;
}

rsmi_status_t rsmi_dev_busy_percent_get(uint32_t dv_ind, uint32_t *busy_percent)
{
    struct device dev;
    rsmi_status_t status = busy_percent == NULL ? RSMI_STATUS_INVALID_ARGS : get(dv_ind, &dev, 0);
    if (status == RSMI_STATUS_SUCCESS)
        *busy_percent = dev.busy;
    return status;
}

rsmi_status_t rsmi_dev_temp_metric_get(uint32_t dv_ind, uint32_t sensor_type, uint32_t metric,
                                       int64_t *temperature)
{
    struct device dev;
    if (temperature == NULL)
        return RSMI_STATUS_INVALID_ARGS;
    rsmi_status_t status = get(dv_ind, &dev, 0);
    if (status != RSMI_STATUS_SUCCESS)
        return status;
    if (sensor_type != TEMP_TYPE_EDGE && sensor_type != TEMP_TYPE_JUNCTION)
        return RSMI_STATUS_NOT_SUPPORTED;
    if (metric == TEMP_CURRENT)
        *temperature = dev.temp_mc;
    else if (metric == TEMP_MAX)
        *temperature = dev.temp_max_mc;
    else
        return RSMI_STATUS_NOT_SUPPORTED;
    return RSMI_STATUS_SUCCESS;
}

rsmi_status_t rsmi_dev_power_ave_get(uint32_t dv_ind, uint32_t sensor_ind, uint64_t *power)
{
    struct device dev;
    if (power == NULL)
        return RSMI_STATUS_INVALID_ARGS;
    rsmi_status_t status = get(dv_ind, &dev, 0);
    if (status == RSMI_STATUS_SUCCESS && sensor_ind != 0)
        return RSMI_STATUS_NOT_SUPPORTED;
    if (status == RSMI_STATUS_SUCCESS)
        *power = dev.power_uw;
    return status;
}

static rsmi_status_t memory(uint32_t dv_ind, uint32_t mem_type, uint64_t *out, int used)
{
    struct device dev;
    if (out == NULL)
        return RSMI_STATUS_INVALID_ARGS;
    rsmi_status_t status = get(dv_ind, &dev, 0);
    if (status == RSMI_STATUS_SUCCESS && mem_type != MEM_TYPE_VRAM)
        return RSMI_STATUS_NOT_SUPPORTED;
    if (status == RSMI_STATUS_SUCCESS)
        *out = used ? dev.vram_used : dev.vram_total;
    return status;
}

rsmi_status_t rsmi_dev_memory_total_get(uint32_t dv_ind, uint32_t mem_type, uint64_t *total)
{
    return memory(dv_ind, mem_type, total, 0);
}

rsmi_status_t rsmi_dev_memory_usage_get(uint32_t dv_ind, uint32_t mem_type, uint64_t *used)
{
    return memory(dv_ind, mem_type, used, 1);
}

rsmi_status_t rsmi_dev_ecc_count_get(uint32_t dv_ind, uint64_t block, rsmi_error_count_t *ec)
{
    struct device dev;
    if (ec == NULL)
        return RSMI_STATUS_INVALID_ARGS;
    rsmi_status_t status = get(dv_ind, &dev, 0);
    if (status != RSMI_STATUS_SUCCESS)
        return status;
    ec->correctable_err = block == BLOCK_UMC ? dev.ecc_ce : 0;
    ec->uncorrectable_err = block == BLOCK_UMC ? dev.ecc_ue : 0;
    return RSMI_STATUS_SUCCESS;
}

/* ---- Events ------------------------------------------------------------------------------- */

static long events_size(void)
{
    char path[PATH_MAX + 8];
    struct stat info;
    if (sibling(".events", path, sizeof path) != 0 || stat(path, &info) != 0)
        return 0;
    return (long)info.st_size;
}

rsmi_status_t rsmi_event_notification_init(uint32_t dv_ind)
{
    rsmi_status_t status = RSMI_STATUS_SUCCESS;
    pthread_mutex_lock(&lock);
    if (init_count == 0)
        status = RSMI_STATUS_INIT_ERROR;
    else if (dv_ind >= device_count)
        status = RSMI_STATUS_INVALID_ARGS;
    else if (!event_started[dv_ind]) {
        if (events_open++ == 0)
            events_offset = events_size();
        event_started[dv_ind] = 1;
        event_masks[dv_ind] = 0;
    }
    pthread_mutex_unlock(&lock);
    return status;
}

rsmi_status_t rsmi_event_notification_mask_set(uint32_t dv_ind, uint64_t mask)
{
    rsmi_status_t status = RSMI_STATUS_SUCCESS;
    pthread_mutex_lock(&lock);
    if (dv_ind >= MAX_DEVICES || !event_started[dv_ind])
        status = RSMI_STATUS_INIT_ERROR;
    else
        event_masks[dv_ind] = mask;
    pthread_mutex_unlock(&lock);
    return status;
}

rsmi_status_t rsmi_event_notification_stop(uint32_t dv_ind)
{
    pthread_mutex_lock(&lock);
    if (dv_ind < MAX_DEVICES && event_started[dv_ind]) {
        event_started[dv_ind] = 0;
        event_masks[dv_ind] = 0;
        events_open--;
    }
    pthread_mutex_unlock(&lock);
    return RSMI_STATUS_SUCCESS;
}

/* One event line into `out`; 1 when it is for a started device whose mask has its kind. */
static int parse_event(char *line, rsmi_evt_notification_data_t *out)
{
    char *save = NULL;
    char *field = strtok_r(line, "\t\n", &save);
    long dcu = -1, kind = 0;
    if (field == NULL || strcmp(field, "event") != 0)
        return 0;
    memset(out, 0, sizeof *out);
    while ((field = strtok_r(NULL, "\t\n", &save)) != NULL) {
        if (strncmp(field, "dcu=", 4) == 0)
            dcu = strtol(field + 4, NULL, 10);
        else if (strncmp(field, "kind=", 5) == 0)
            kind = strtol(field + 5, NULL, 10);
        else if (strncmp(field, "message=", 8) == 0)
            snprintf(out->message, sizeof out->message, "%s", field + 8);
    }
    if (dcu < 0 || dcu >= MAX_DEVICES || kind < 1 || kind > 64 || !event_started[dcu] ||
        (event_masks[dcu] & (1ULL << (kind - 1))) == 0)
        return 0;
    out->dv_ind = (uint32_t)dcu;
    out->event = (int32_t)kind;
    return 1;
}

/* Caller holds the lock. Delivers up to `capacity` new events; consumes only what it read. */
static uint32_t collect(rsmi_evt_notification_data_t *data, uint32_t capacity)
{
    char path[PATH_MAX + 8];
    char line[512];
    uint32_t found = 0;
    FILE *file;
    if (sibling(".events", path, sizeof path) != 0 || (file = fopen(path, "r")) == NULL)
        return 0;
    if (fseek(file, events_offset, SEEK_SET) == 0) {
        while (found < capacity && fgets(line, sizeof line, file) != NULL) {
            size_t length = strlen(line);
            if (length == 0 || line[length - 1] != '\n')
                break; /* a line still being written: read it next time */
            events_offset += (long)length;
            found += (uint32_t)parse_event(line, &data[found]);
        }
    }
    fclose(file);
    return found;
}

rsmi_status_t rsmi_event_notification_get(int timeout_ms, uint32_t *num_elem,
                                          rsmi_evt_notification_data_t *data)
{
    struct timespec step = {0, 10 * 1000 * 1000};
    long waited_ms = 0;
    if (num_elem == NULL || data == NULL || *num_elem == 0)
        return RSMI_STATUS_INVALID_ARGS;
    uint32_t capacity = *num_elem;
    *num_elem = 0;
    for (;;) {
        pthread_mutex_lock(&lock);
        uint32_t found = events_open > 0 ? collect(data, capacity) : 0;
        pthread_mutex_unlock(&lock);
        if (found > 0) {
            *num_elem = found;
            return RSMI_STATUS_SUCCESS;
        }
        if (waited_ms >= timeout_ms)
            return RSMI_STATUS_NO_DATA;
        nanosleep(&step, NULL);
        waited_ms += 10;
    }
}
