/*
 * A fake libnvidia-ml.so.1 for simulated nodes.
 *
 * It serves a profile's GPUs to the real NVML bindings (pynvml) so that discovery, health and
 * the device plugin run the same code on a laptop as on a GPU node. It reads no environment:
 * at nvmlInit it finds its own file with dladdr(), resolves symlinks, and loads the data file
 * "<that path>.sim" (written by edl_agent/sim/nvidia_tree.py). Several copies loaded from
 * different simulated trees therefore coexist in one process, each with its own node.
 *
 * Data file: one record per line, fields separated by tabs, the first field naming the record
 * and the others "key=value"; blank lines and lines starting with '#' are ignored.
 *
 *   format   version=1                                       (first record)
 *   system   driver=550.90.07  nvml=12.550.90.07  cuda=12040
 *   gpu      index=0  uuid=GPU-...  name=...  memory_mib=81559  bus_id=00000000:18:00.0
 *            [minor=0] [numa_node=0] [compute_capability=9.0] [architecture=9] [brand=14]
 *            [serial=...] [mig=unsupported|disabled|enabled] [power_limit_w=700] [nvlinks=18]
 *            [cpus=0-31,64-95]   (the CPUs near the GPU, a cpulist as in sysfs)
 *            [pcie_gen_max=5] [pcie_width_max=16]   (the fastest PCIe link the GPU trains at
 *            in its slot; defaults: generation 5 from Hopper on, 4 for Ampere and Ada, 3 before
 *            or unknown; width 16)
 *            [lost=1]   (fallen off the bus: every query on it and its MIG devices fails)
 *   mig      gpu=0  index=0  uuid=MIG-...  name=... MIG 3g.40gb  memory_mib=40192
 *            gpu_instance=1  compute_instance=0
 *   nvlink   gpu=0  link=0  remote=00000000:20:00.0
 *
 * gpu records come in index order; mig and nvlink records name an earlier gpu. An unknown
 * record or key is an error, so a typo never passes silently. A missing data file makes
 * nvmlInit return NVML_ERROR_DRIVER_NOT_LOADED (as on a node without the kernel module); a
 * malformed one makes it return NVML_ERROR_UNKNOWN and print the file, line and reason to
 * stderr.
 *
 * Fault file: "<library path>.faults", append-only, one fault per line, the verb first and then
 * space-separated fields (written by edl_agent/sim/inject.py; blank lines and '#' ignored):
 *
 *   xid        gpu=3 code=79 [mig=1] [action=N]
 *                                      an XID critical error (mig: index of the MIG device it
 *                                      is attributed to, reported as GPU/compute instance ids;
 *                                      action: the GPU recovery action the driver reports after
 *                                      it, nvmlDeviceGpuRecoveryAction_t, e.g. 1 GPU_RESET)
 *   ecc_dbe    gpu=3                   a double-bit ECC error: uncorrected counters + 1
 *   ecc_sbe    gpu=3 [count=N]         single-bit ECC errors: corrected counters + N (default 1);
 *                                      one event per line whatever N, so a test can add many
 *                                      errors without a flood of events
 *   lost       gpu=3                   the GPU falls off the bus (recovery action NODE_REBOOT)
 *   recover    gpu=3                   a lost GPU answers again
 *   reset      gpu=3                   the GPU was reset: volatile ECC counters back to 0, pending
 *                                      row remapping applied, the PCIe link trained at its maximum
 *                                      again, recovery action NONE; a reset does not reach a lost
 *                                      GPU or one that needs a reboot
 *   reboot                             the node rebooted: every GPU as after a reset, lost GPUs
 *                                      back, init_fail off (aggregate ECC counters, failed row
 *                                      remappings and clocks-event reasons stay)
 *   init_fail  on|off                  nvmlInit fails with NVML_ERROR_DRIVER_NOT_LOADED while on
 *   telemetry  gpu=3 [temperature_c=N] [power_w=N] [utilization=N] [memory_used_mib=N]
 *   clocks     gpu=3 reasons=0x48      the current clocks-event (throttle) reasons, a bit mask
 *                                      of nvmlClocksEventReason* in decimal or 0x hex, answered
 *                                      exactly (reasons=0: none); until a clocks line, GPU_IDLE
 *                                      (0x1) as an idle GPU reports. A reset does not change it:
 *                                      a slowdown lasts while its cause (heat, power) does
 *   pcie       gpu=3 [gen=N] [width=N] the link trained at this generation and/or width (a
 *                                      downgrade; at most the maximum); a reset restores both
 *   remap      gpu=3 [pending=N] [failed=N]
 *                                      N rows of memory wait to be remapped / could not be
 *                                      remapped (each given value replaces the last). Pending
 *                                      rows count as remapped uncorrectable rows at once and are
 *                                      applied by a reset (pending back to 0); a failed remapping
 *                                      is kept in the InfoROM, so no reset or reboot clears it
 *
 * nvmlDeviceGetRemappedRows answers as NVML does: row counts (corrected 0; uncorrected one row per
 * double-bit error plus the rows of remap lines) and two flags, isPending (rows of a remap line
 * pending, or a double-bit error since the last reset) and failureOccurred (failed > 0).
 *
 * nvmlDeviceGetFieldValues answers NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (what the driver says the
 * GPU needs: an XID with action=, a double-bit ECC error (GPU_RESET) or a lost GPU (NODE_REBOOT)
 * set it; reset and reboot clear it) and NOT_SUPPORTED for any other field.
 *
 * State (lost GPUs, init_fail, ECC counters, recovery actions, telemetry, clocks, PCIe links, row
 * remapping) is the fold of the whole file, redone at the first nvmlInit of a process and brought
 * up to date on later calls, so a restarted agent still sees a lost GPU. Events go only to event
 * sets that existed when the line was appended: a set starts reading at the file's end when it
 * is created, so nothing is replayed. A malformed line is reported on stderr and skipped.
 *
 * Events, as a real driver reports them: xid -> nvmlEventTypeXidCriticalError with eventData =
 * code; ecc_dbe/ecc_sbe -> nvmlEventTypeDoubleBitEccError/SingleBitEccError (clocks, pcie and
 * remap lines raise no event: NVML reports them only when asked); lost -> an XID 79
 * event (the driver's "GPU has fallen off the bus"), after which every query on that GPU and
 * its MIG devices returns NVML_ERROR_GPU_IS_LOST. The event's device is always the physical
 * GPU; for MIG, gpuInstanceId/computeInstanceId name the instance (0xFFFFFFFF when none).
 * While init_fail is on, nvmlEventSetWait returns NVML_ERROR_UNKNOWN: the driver is gone.
 * nvmlEventSetWait sleeps in poll() on an inotify watch of the library's directory, so an
 * appended line wakes it at once and an idle wait costs no CPU.
 *
 * Layout of this file: NVML types, the device table, the data-file parser, the fault file,
 * then the API in groups (lifecycle, system, device identity, memory/PCI, MIG, MIG instances,
 * NVLink/topology, telemetry and clocks, ECC, field values, events).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- NVML types and constants (values as in nvml.h) ------------------------------------ */

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

enum { NVML_FEATURE_DISABLED = 0, NVML_FEATURE_ENABLED = 1 };
enum { NVML_DEVICE_MIG_DISABLE = 0, NVML_DEVICE_MIG_ENABLE = 1 };
enum { NVML_TEMPERATURE_GPU = 0 };
enum {
    NVML_TOPOLOGY_INTERNAL = 0,
    NVML_TOPOLOGY_NODE = 40,
    NVML_TOPOLOGY_SYSTEM = 50,
};
#define NVML_DEVICE_ARCH_AMPERE 7u
#define NVML_DEVICE_ARCH_HOPPER 9u
#define NVML_DEVICE_ARCH_UNKNOWN 0xffffffffu
#define NVML_NVLINK_MAX_LINKS 36 /* nvml.h of CUDA 12.8+; older headers say 18 */
enum { NVML_AFFINITY_SCOPE_NODE = 0, NVML_AFFINITY_SCOPE_SOCKET = 1 };
typedef unsigned int nvmlAffinityScope_t;
#define NVML_MEMORY_V2 0x02000028u /* sizeof(nvmlMemory_v2_t) | 2 << 24 */
#define PCI_VENDOR_NVIDIA 0x10deu
#define NVML_VALUE_NOT_AVAILABLE 0xffffffffu
#define NVML_CLOCKS_EVENT_REASON_GPU_IDLE 0x1ull
#define PCIE_GEN_HIGHEST 6u
#define PCIE_WIDTH_HIGHEST 32u

enum { NVML_MEMORY_ERROR_TYPE_CORRECTED = 0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1 };
enum { NVML_VOLATILE_ECC = 0, NVML_AGGREGATE_ECC = 1 };
enum {
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0,
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1,
};

#define nvmlEventTypeSingleBitEccError 0x1ull
#define nvmlEventTypeDoubleBitEccError 0x2ull
#define nvmlEventTypePState 0x4ull
#define nvmlEventTypeXidCriticalError 0x8ull
#define nvmlEventTypeClock 0x10ull
#define SUPPORTED_EVENTS                                                                      \
    (nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypePState | \
     nvmlEventTypeXidCriticalError | nvmlEventTypeClock)
#define XID_GPU_FALLEN_OFF_THE_BUS 79
#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230
enum {
    NVML_GPU_RECOVERY_ACTION_NONE = 0,
    NVML_GPU_RECOVERY_ACTION_GPU_RESET = 1,
    NVML_GPU_RECOVERY_ACTION_NODE_REBOOT = 2,
    NVML_GPU_RECOVERY_ACTION_MAX = 7,
};
enum { NVML_VALUE_TYPE_UNSIGNED_INT = 1 };

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    unsigned int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

/* ---- The device table -------------------------------------------------------------------- */

#define MAX_GPUS 64
#define MAX_MIGS_PER_GPU 7
#define TEXT 96
#define MAX_CPUS 4096
#define WORD_BITS (8 * sizeof(unsigned long))
#define CPU_WORDS (MAX_CPUS / WORD_BITS)

enum mig_mode { MIG_UNSUPPORTED, MIG_DISABLED, MIG_ENABLED };

struct pci_address {
    unsigned int domain, bus, device, function;
};

struct nvlink {
    int active;
    struct pci_address remote;
};

/* One GPU or one MIG device; a handle is a pointer to one of these. */
struct nvmlDevice_st {
    int is_mig;
    unsigned int index; /* GPU index, or the MIG device's index within its parent */
    char uuid[TEXT];
    char name[TEXT];
    unsigned long long memory_mib;

    /* GPUs */
    char serial[32];
    struct pci_address pci;
    unsigned int minor;
    int numa_node;
    int cc_major, cc_minor;
    unsigned int architecture;
    unsigned int brand;
    enum mig_mode mig_mode;
    int lost;
    unsigned int power_limit_mw;
    unsigned int nvlink_count;
    struct nvlink nvlinks[NVML_NVLINK_MAX_LINKS];
    int has_cpus;
    unsigned long cpus[CPU_WORDS]; /* bit i: CPU i is near the GPU */
    unsigned int mig_count;
    struct nvmlDevice_st *migs[MAX_MIGS_PER_GPU];

    /* MIG devices */
    struct nvmlDevice_st *parent;
    unsigned int gpu_instance_id;
    unsigned int compute_instance_id;

    /* GPUs: state the fault file changes while other threads read it (always via atomics). */
    int base_lost; /* lost=1 in the data file */
    unsigned long long ecc_corrected;   /* aggregate: the GPU's whole life */
    unsigned long long ecc_uncorrected;
    unsigned long long ecc_corrected_volatile; /* since the last reset or reboot */
    unsigned long long ecc_uncorrected_volatile;
    unsigned int recovery_action;
    unsigned int temperature_c;
    unsigned int power_usage_mw;
    unsigned int utilization_gpu;
    unsigned int utilization_memory;
    unsigned long long memory_used_mib; /* in use by applications, beyond the driver's share */
    unsigned long long clock_reasons;   /* nvmlClocksEventReason* bits */
    unsigned int pcie_gen_max, pcie_width_max; /* from the data file; never change */
    unsigned int pcie_gen, pcie_width;         /* what the link trained at */
    unsigned int rows_pending;  /* rows of remap lines waiting for a reset */
    unsigned long long rows_remapped; /* rows of remap lines a reset applied */
    unsigned int rows_failed;
};

typedef struct nvmlDevice_st *nvmlDevice_t;

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned int init_count;

static char driver_version[TEXT];
static char nvml_version[TEXT];
static int cuda_driver_version;
static struct nvmlDevice_st gpus[MAX_GPUS];
static unsigned int gpu_count;
static struct nvmlDevice_st migs[MAX_GPUS * MAX_MIGS_PER_GPU];
static unsigned int mig_total;

static void sync_faults(void);

static int get_int(const int *at)
{
    return __atomic_load_n(at, __ATOMIC_ACQUIRE);
}

static void set_int(int *at, int value)
{
    __atomic_store_n(at, value, __ATOMIC_RELEASE);
}

static unsigned int get_uint(const unsigned int *at)
{
    return __atomic_load_n(at, __ATOMIC_RELAXED);
}

static void set_uint(unsigned int *at, unsigned int value)
{
    __atomic_store_n(at, value, __ATOMIC_RELAXED);
}

static unsigned long long get_ull(const unsigned long long *at)
{
    return __atomic_load_n(at, __ATOMIC_RELAXED);
}

static void set_ull(unsigned long long *at, unsigned long long value)
{
    __atomic_store_n(at, value, __ATOMIC_RELAXED);
}

static int initialized(void)
{
    return __atomic_load_n(&init_count, __ATOMIC_ACQUIRE) > 0;
}

static struct nvmlDevice_st *in_table(nvmlDevice_t handle, struct nvmlDevice_st *table,
                                      unsigned int count)
{
    uintptr_t at = (uintptr_t)handle, first = (uintptr_t)table;
    if (at < first || at >= first + count * sizeof *table || (at - first) % sizeof *table)
        return NULL;
    return handle;
}

/* MIG devices share their parent's physical facts (compute capability, brand, being lost). */
static struct nvmlDevice_st *physical(struct nvmlDevice_st *d)
{
    return d->is_mig ? d->parent : d;
}

/* Any valid handle (GPU or MIG device) of a GPU still on the bus. */
static nvmlReturn_t lookup(nvmlDevice_t handle, struct nvmlDevice_st **out)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    *out = in_table(handle, gpus, gpu_count);
    if (*out == NULL)
        *out = in_table(handle, migs, mig_total);
    if (*out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    sync_faults();
    return get_int(&physical(*out)->lost) ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

/* A valid handle of a whole GPU; MIG devices do not support the query. */
static nvmlReturn_t lookup_gpu(nvmlDevice_t handle, struct nvmlDevice_st **out)
{
    nvmlReturn_t ret = lookup(handle, out);
    if (ret == NVML_SUCCESS && (*out)->is_mig)
        return NVML_ERROR_NOT_SUPPORTED;
    return ret;
}

static nvmlReturn_t copy_text(char *buffer, unsigned int length, const char *text)
{
    if (buffer == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(text) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buffer, text, strlen(text) + 1);
    return NVML_SUCCESS;
}

static int parse_pci(const char *text, struct pci_address *out)
{
    char end;
    return sscanf(text, "%x:%x:%x.%x%c", &out->domain, &out->bus, &out->device, &out->function,
                  &end) == 4;
}

static int same_pci(const struct pci_address *a, const struct pci_address *b)
{
    return a->domain == b->domain && a->bus == b->bus && a->device == b->device &&
           a->function == b->function;
}

static void fill_pci_info(const struct pci_address *pci, nvmlPciInfo_t *info)
{
    memset(info, 0, sizeof *info);
    info->domain = pci->domain;
    info->bus = pci->bus;
    info->device = pci->device;
    info->pciDeviceId = PCI_VENDOR_NVIDIA; /* the device id half is not simulated */
    snprintf(info->busIdLegacy, sizeof info->busIdLegacy, "%04X:%02X:%02X.%X", pci->domain,
             pci->bus, pci->device, pci->function);
    snprintf(info->busId, sizeof info->busId, "%08X:%02X:%02X.%X", pci->domain, pci->bus,
             pci->device, pci->function);
}

/* ---- The data file ----------------------------------------------------------------------- */

#define MAX_FIELDS 24

struct record {
    unsigned int count;
    char *keys[MAX_FIELDS];
    char *values[MAX_FIELDS];
};

struct parser {
    const char *path;
    unsigned int line;
    char *error;
    size_t error_size;
};

static int fail(struct parser *p, const char *what, const char *detail)
{
    snprintf(p->error, p->error_size, "%s:%u: %s%s", p->path, p->line, what, detail);
    return 0;
}

/* Split "type\tk=v\tk=v" in place; every field after the first must be key=value. */
static int split_record(struct parser *p, char *line, char **type, struct record *r)
{
    char *field = strsep(&line, "\t");
    *type = field;
    r->count = 0;
    while ((field = strsep(&line, "\t")) != NULL) {
        char *equals = strchr(field, '=');
        if (equals == NULL || equals == field)
            return fail(p, "expected key=value, got ", field);
        if (r->count == MAX_FIELDS)
            return fail(p, "too many fields", "");
        *equals = '\0';
        r->keys[r->count] = field;
        r->values[r->count] = equals + 1;
        r->count++;
    }
    return 1;
}

static int check_keys(struct parser *p, const struct record *r, const char *const *allowed)
{
    for (unsigned int i = 0; i < r->count; i++) {
        const char *const *key = allowed;
        while (*key && strcmp(*key, r->keys[i]) != 0)
            key++;
        if (*key == NULL)
            return fail(p, "unknown key ", r->keys[i]);
        for (unsigned int j = 0; j < i; j++)
            if (strcmp(r->keys[j], r->keys[i]) == 0)
                return fail(p, "repeated key ", r->keys[i]);
    }
    return 1;
}

static const char *value_of(const struct record *r, const char *key)
{
    for (unsigned int i = 0; i < r->count; i++)
        if (strcmp(r->keys[i], key) == 0)
            return r->values[i];
    return NULL;
}

static int get_text(struct parser *p, const struct record *r, const char *key, int required,
                    char *out, size_t size)
{
    const char *value = value_of(r, key);
    if (value == NULL)
        return required ? fail(p, "missing key ", key) : 1;
    if (strlen(value) + 1 > size)
        return fail(p, "value too long for ", key);
    memcpy(out, value, strlen(value) + 1);
    return 1;
}

static int get_number(struct parser *p, const struct record *r, const char *key, int required,
                      long long low, long long high, long long *out)
{
    const char *value = value_of(r, key);
    char *end;
    if (value == NULL)
        return required ? fail(p, "missing key ", key) : 1;
    long long number = strtoll(value, &end, 10);
    if (*value == '\0' || *end != '\0' || number < low || number > high)
        return fail(p, "bad number for ", key);
    *out = number;
    return 1;
}

static int get_unsigned(struct parser *p, const struct record *r, const char *key, int required,
                        unsigned int high, unsigned int *out)
{
    long long number = *out;
    if (!get_number(p, r, key, required, 0, high, &number))
        return 0;
    *out = (unsigned int)number;
    return 1;
}

static int get_pci(struct parser *p, const struct record *r, const char *key,
                   struct pci_address *out)
{
    const char *value = value_of(r, key);
    if (value == NULL)
        return fail(p, "missing key ", key);
    if (!parse_pci(value, out))
        return fail(p, "bad PCI bus id for ", key);
    return 1;
}

/* A cpulist as sysfs writes it ("0-31,64-95"), as a CPU bit mask. */
static int get_cpus(struct parser *p, const struct record *r, const char *key, int *has,
                    unsigned long *mask)
{
    const char *value = value_of(r, key), *at;
    char *end;
    if (value == NULL)
        return 1;
    memset(mask, 0, CPU_WORDS * sizeof *mask);
    for (at = value;; at = end + 1) {
        unsigned long first = strtoul(at, &end, 10), last = first;
        if (end == at)
            return fail(p, "bad cpulist for ", key);
        if (*end == '-') {
            at = end + 1;
            last = strtoul(at, &end, 10);
            if (end == at)
                return fail(p, "bad cpulist for ", key);
        }
        if (first > last || last >= MAX_CPUS)
            return fail(p, "bad CPU range in ", key);
        for (unsigned long cpu = first; cpu <= last; cpu++)
            mask[cpu / WORD_BITS] |= 1ul << (cpu % WORD_BITS);
        if (*end == '\0')
            break;
        if (*end != ',')
            return fail(p, "bad cpulist for ", key);
    }
    *has = 1;
    return 1;
}

static int parse_system(struct parser *p, const struct record *r)
{
    static const char *const keys[] = {"driver", "nvml", "cuda", NULL};
    long long cuda = 0;
    if (!check_keys(p, r, keys) ||
        !get_text(p, r, "driver", 1, driver_version, sizeof driver_version) ||
        !get_text(p, r, "nvml", 1, nvml_version, sizeof nvml_version) ||
        !get_number(p, r, "cuda", 1, 0, INT_MAX, &cuda))
        return 0;
    cuda_driver_version = (int)cuda;
    return 1;
}

/* What a reset clears: volatile counters, pending remaps (they are applied), a downgraded PCIe
 * link (it trains again), the action. */
static void after_reset(struct nvmlDevice_st *gpu)
{
    set_ull(&gpu->ecc_corrected_volatile, 0);
    set_ull(&gpu->ecc_uncorrected_volatile, 0);
    set_ull(&gpu->rows_remapped, get_ull(&gpu->rows_remapped) + get_uint(&gpu->rows_pending));
    set_uint(&gpu->rows_pending, 0);
    set_uint(&gpu->pcie_gen, gpu->pcie_gen_max);
    set_uint(&gpu->pcie_width, gpu->pcie_width_max);
    set_uint(&gpu->recovery_action, NVML_GPU_RECOVERY_ACTION_NONE);
}

/* The data file's view of a GPU, before any fault. */
static void reset_dynamic(struct nvmlDevice_st *gpu)
{
    set_int(&gpu->lost, gpu->base_lost);
    set_ull(&gpu->ecc_corrected, 0);
    set_ull(&gpu->ecc_uncorrected, 0);
    set_uint(&gpu->rows_pending, 0);
    set_ull(&gpu->rows_remapped, 0);
    set_uint(&gpu->rows_failed, 0);
    set_ull(&gpu->clock_reasons, NVML_CLOCKS_EVENT_REASON_GPU_IDLE);
    after_reset(gpu);
    set_uint(&gpu->temperature_c, 33 + gpu->index % 4);
    set_uint(&gpu->power_usage_mw, gpu->power_limit_mw / 10);
    set_uint(&gpu->utilization_gpu, 0);
    set_uint(&gpu->utilization_memory, 0);
    set_ull(&gpu->memory_used_mib, 0);
}

/* The PCIe generation of the GPUs of an architecture (Ada, 8, is a generation 4 part too). */
static unsigned int default_pcie_gen(unsigned int architecture)
{
    if (architecture == NVML_DEVICE_ARCH_UNKNOWN || architecture < NVML_DEVICE_ARCH_AMPERE)
        return 3;
    return architecture >= NVML_DEVICE_ARCH_HOPPER ? 5 : 4;
}

static int parse_gpu(struct parser *p, const struct record *r)
{
    static const char *const keys[] = {
        "index", "uuid", "name", "memory_mib", "bus_id", "minor", "numa_node",
        "compute_capability", "architecture", "brand", "serial", "mig", "power_limit_w",
        "nvlinks", "cpus", "lost", "pcie_gen_max", "pcie_width_max", NULL};
    struct nvmlDevice_st *gpu;
    unsigned int index = 0, power_w = 0, lost = 0;
    long long memory = 0, numa = -1;
    char capability[16] = "0.0", mig[16] = "unsupported";

    if (!check_keys(p, r, keys) || !get_unsigned(p, r, "index", 1, MAX_GPUS, &index))
        return 0;
    if (index != gpu_count)
        return fail(p, "gpu records must come in index order", "");
    if (gpu_count == MAX_GPUS)
        return fail(p, "too many GPUs", "");
    gpu = &gpus[gpu_count];
    memset(gpu, 0, sizeof *gpu);
    gpu->index = index;
    gpu->minor = index;
    gpu->architecture = NVML_DEVICE_ARCH_UNKNOWN;
    if (!get_text(p, r, "uuid", 1, gpu->uuid, sizeof gpu->uuid) ||
        !get_text(p, r, "name", 1, gpu->name, sizeof gpu->name) ||
        !get_number(p, r, "memory_mib", 1, 1, 1LL << 30, &memory) ||
        !get_pci(p, r, "bus_id", &gpu->pci) ||
        !get_unsigned(p, r, "minor", 0, 255, &gpu->minor) ||
        !get_number(p, r, "numa_node", 0, -1, 1023, &numa) ||
        !get_text(p, r, "compute_capability", 0, capability, sizeof capability) ||
        !get_unsigned(p, r, "architecture", 0, UINT_MAX, &gpu->architecture) ||
        !get_unsigned(p, r, "brand", 0, 1000, &gpu->brand) ||
        !get_text(p, r, "serial", 0, gpu->serial, sizeof gpu->serial) ||
        !get_text(p, r, "mig", 0, mig, sizeof mig) ||
        !get_unsigned(p, r, "power_limit_w", 0, 100000, &power_w) ||
        !get_unsigned(p, r, "nvlinks", 0, NVML_NVLINK_MAX_LINKS, &gpu->nvlink_count) ||
        !get_cpus(p, r, "cpus", &gpu->has_cpus, gpu->cpus) ||
        !get_unsigned(p, r, "lost", 0, 1, &lost))
        return 0;
    gpu->pcie_gen_max = default_pcie_gen(gpu->architecture);
    gpu->pcie_width_max = 16;
    if (!get_unsigned(p, r, "pcie_gen_max", 0, PCIE_GEN_HIGHEST, &gpu->pcie_gen_max) ||
        !get_unsigned(p, r, "pcie_width_max", 0, PCIE_WIDTH_HIGHEST, &gpu->pcie_width_max))
        return 0;
    if (gpu->pcie_gen_max == 0 || gpu->pcie_width_max == 0)
        return fail(p, "pcie_gen_max and pcie_width_max must be at least 1", "");
    if (sscanf(capability, "%d.%d", &gpu->cc_major, &gpu->cc_minor) != 2)
        return fail(p, "bad compute_capability ", capability);
    if (strcmp(mig, "unsupported") == 0)
        gpu->mig_mode = MIG_UNSUPPORTED;
    else if (strcmp(mig, "disabled") == 0)
        gpu->mig_mode = MIG_DISABLED;
    else if (strcmp(mig, "enabled") == 0)
        gpu->mig_mode = MIG_ENABLED;
    else
        return fail(p, "bad mig mode ", mig);
    gpu->memory_mib = (unsigned long long)memory;
    gpu->numa_node = (int)numa;
    gpu->base_lost = (int)lost;
    gpu->power_limit_mw = power_w * 1000;
    reset_dynamic(gpu);
    gpu_count++;
    return 1;
}

static int parse_mig(struct parser *p, const struct record *r)
{
    static const char *const keys[] = {"gpu", "index", "uuid", "name", "memory_mib",
                                       "gpu_instance", "compute_instance", NULL};
    unsigned int parent_index = 0, index = 0;
    long long memory = 0;
    struct nvmlDevice_st *parent, *mig;

    if (!check_keys(p, r, keys) || !get_unsigned(p, r, "gpu", 1, UINT_MAX, &parent_index) ||
        !get_unsigned(p, r, "index", 1, UINT_MAX, &index))
        return 0;
    if (parent_index >= gpu_count)
        return fail(p, "mig record names an unknown gpu", "");
    parent = &gpus[parent_index];
    if (parent->mig_mode != MIG_ENABLED)
        return fail(p, "mig record on a GPU whose MIG mode is not enabled", "");
    if (index != parent->mig_count || index >= MAX_MIGS_PER_GPU)
        return fail(p, "mig records of a GPU must come in index order, at most 7", "");
    mig = &migs[mig_total];
    memset(mig, 0, sizeof *mig);
    mig->is_mig = 1;
    mig->index = index;
    mig->parent = parent;
    if (!get_text(p, r, "uuid", 1, mig->uuid, sizeof mig->uuid) ||
        !get_text(p, r, "name", 1, mig->name, sizeof mig->name) ||
        !get_number(p, r, "memory_mib", 1, 1, 1LL << 30, &memory) ||
        !get_unsigned(p, r, "gpu_instance", 1, UINT_MAX, &mig->gpu_instance_id) ||
        !get_unsigned(p, r, "compute_instance", 1, UINT_MAX, &mig->compute_instance_id))
        return 0;
    mig->memory_mib = (unsigned long long)memory;
    parent->migs[parent->mig_count++] = mig;
    mig_total++;
    return 1;
}

static int parse_nvlink(struct parser *p, const struct record *r)
{
    static const char *const keys[] = {"gpu", "link", "remote", NULL};
    unsigned int gpu_index = 0, link = 0;
    struct nvmlDevice_st *gpu;

    if (!check_keys(p, r, keys) || !get_unsigned(p, r, "gpu", 1, UINT_MAX, &gpu_index) ||
        !get_unsigned(p, r, "link", 1, UINT_MAX, &link))
        return 0;
    if (gpu_index >= gpu_count)
        return fail(p, "nvlink record names an unknown gpu", "");
    gpu = &gpus[gpu_index];
    if (link >= gpu->nvlink_count)
        return fail(p, "nvlink record beyond the GPU's nvlinks", "");
    if (!get_pci(p, r, "remote", &gpu->nvlinks[link].remote))
        return 0;
    gpu->nvlinks[link].active = 1;
    return 1;
}

static int parse_line(struct parser *p, char *line, int *seen_format)
{
    struct record r;
    char *type;
    long long version = 0;
    static const char *const format_keys[] = {"version", NULL};

    if (!split_record(p, line, &type, &r))
        return 0;
    if (!*seen_format) {
        if (strcmp(type, "format") != 0 || !check_keys(p, &r, format_keys) ||
            !get_number(p, &r, "version", 1, 0, INT_MAX, &version))
            return fail(p, "not a fake NVML data file (expected format version=1 first)", "");
        if (version != 1)
            return fail(p, "unsupported data file version", "");
        *seen_format = 1;
        return 1;
    }
    if (strcmp(type, "system") == 0)
        return parse_system(p, &r);
    if (strcmp(type, "gpu") == 0)
        return parse_gpu(p, &r);
    if (strcmp(type, "mig") == 0)
        return parse_mig(p, &r);
    if (strcmp(type, "nvlink") == 0)
        return parse_nvlink(p, &r);
    return fail(p, "unknown record ", type);
}

/* Fill the device table from `path`; NVML_SUCCESS, or an error code with `error` explained. */
static nvmlReturn_t load_data(const char *path, char *error, size_t error_size)
{
    struct parser p = {path, 0, error, error_size};
    FILE *file = fopen(path, "r");
    char *line = NULL;
    size_t capacity = 0;
    ssize_t length;
    int ok = 1, seen_format = 0;

    if (file == NULL) {
        snprintf(error, error_size, "%s: cannot open the data file", path);
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    gpu_count = 0;
    mig_total = 0;
    driver_version[0] = nvml_version[0] = '\0';
    cuda_driver_version = 0;
    while (ok && (length = getline(&line, &capacity, file)) != -1) {
        p.line++;
        while (length > 0 && (line[length - 1] == '\n' || line[length - 1] == '\r'))
            line[--length] = '\0';
        if (length == 0 || line[0] == '#')
            continue;
        ok = parse_line(&p, line, &seen_format);
    }
    free(line);
    fclose(file);
    if (ok && !seen_format)
        ok = fail(&p, "not a fake NVML data file (empty)", "");
    if (ok && driver_version[0] == '\0')
        ok = fail(&p, "no system record", "");
    if (!ok) {
        gpu_count = 0;
        mig_total = 0;
        return NVML_ERROR_UNKNOWN;
    }
    return NVML_SUCCESS;
}

/* "<this library's resolved path><suffix>". */
static nvmlReturn_t sibling_path(const char *suffix, char *out, size_t size, char *error,
                                 size_t error_size)
{
    Dl_info info;
    char resolved[PATH_MAX];
    if (dladdr((void *)&sibling_path, &info) == 0 || info.dli_fname == NULL ||
        realpath(info.dli_fname, resolved) == NULL) {
        snprintf(error, error_size, "cannot locate the library's own file");
        return NVML_ERROR_UNKNOWN;
    }
    if ((size_t)snprintf(out, size, "%s%s", resolved, suffix) >= size) {
        snprintf(error, error_size, "library path too long");
        return NVML_ERROR_UNKNOWN;
    }
    return NVML_SUCCESS;
}

/* ---- The fault file ---------------------------------------------------------------------- */

enum fault_kind {
    FAULT_XID,
    FAULT_ECC_DBE,
    FAULT_ECC_SBE,
    FAULT_LOST,
    FAULT_RECOVER,
    FAULT_RESET,
    FAULT_REBOOT,
    FAULT_INIT_FAIL,
    FAULT_TELEMETRY,
    FAULT_CLOCKS,
    FAULT_PCIE,
    FAULT_REMAP,
};

static const struct {
    const char *verb;
    enum fault_kind kind;
} fault_verbs[] = {
    {"xid", FAULT_XID},         {"ecc_dbe", FAULT_ECC_DBE},     {"ecc_sbe", FAULT_ECC_SBE},
    {"lost", FAULT_LOST},       {"recover", FAULT_RECOVER},     {"init_fail", FAULT_INIT_FAIL},
    {"telemetry", FAULT_TELEMETRY}, {"reset", FAULT_RESET},         {"reboot", FAULT_REBOOT},
    {"clocks", FAULT_CLOCKS},   {"pcie", FAULT_PCIE},           {"remap", FAULT_REMAP},
};

#define UNSET (-1LL)

struct fault {
    enum fault_kind kind;
    unsigned int gpu;
    unsigned long long code;
    long long mig;
    long long action;
    int on;
    long long temperature_c, power_w, utilization, memory_used_mib;
    long long count;                 /* ecc_sbe */
    unsigned long long reasons;      /* clocks */
    int has_reasons;
    long long pcie_gen, pcie_width;  /* pcie */
    long long rows_pending, rows_failed; /* remap */
};

static char faults_file[PATH_MAX + 16];
static char faults_dir[PATH_MAX + 16];
static pthread_mutex_t fault_lock = PTHREAD_MUTEX_INITIALIZER;
static off_t faults_applied; /* bytes of the fault file folded into the device table */
static int init_failing;

static int fault_number(const char *key, const char *value, unsigned long long high,
                        long long *out, char *error, size_t size)
{
    char *end;
    errno = 0;
    unsigned long long number = strtoull(value, &end, 10);
    if (*value == '\0' || *value == '-' || *end != '\0' || errno != 0 || number > high) {
        snprintf(error, size, "bad number for %s: %s", key, value);
        return 0;
    }
    *out = (long long)number;
    return 1;
}

/* A bit mask: decimal, or hexadecimal after 0x. */
static int fault_mask(const char *key, const char *value, unsigned long long *out, char *error,
                      size_t size)
{
    int hex = value[0] == '0' && (value[1] == 'x' || value[1] == 'X');
    const char *digits = hex ? value + 2 : value;
    char *end;
    errno = 0;
    unsigned long long number = strtoull(digits, &end, hex ? 16 : 10);
    if (*digits == '\0' || *digits == '-' || *digits == '+' || *end != '\0' || errno != 0) {
        snprintf(error, size, "bad bit mask for %s: %s", key, value);
        return 0;
    }
    *out = number;
    return 1;
}

/* The fields of clocks, pcie and remap lines, and ecc_sbe's count: -1 for another key. */
static int wear_field(struct fault *f, const char *key, const char *value, char *error,
                      size_t size)
{
    if (f->kind == FAULT_ECC_SBE && strcmp(key, "count") == 0)
        return fault_number(key, value, 1000000000, &f->count, error, size);
    if (f->kind == FAULT_CLOCKS && strcmp(key, "reasons") == 0) {
        f->has_reasons = 1;
        return fault_mask(key, value, &f->reasons, error, size);
    }
    if (f->kind == FAULT_PCIE && strcmp(key, "gen") == 0)
        return fault_number(key, value, PCIE_GEN_HIGHEST, &f->pcie_gen, error, size);
    if (f->kind == FAULT_PCIE && strcmp(key, "width") == 0)
        return fault_number(key, value, PCIE_WIDTH_HIGHEST, &f->pcie_width, error, size);
    if (f->kind == FAULT_REMAP && strcmp(key, "pending") == 0)
        return fault_number(key, value, 1000000, &f->rows_pending, error, size);
    if (f->kind == FAULT_REMAP && strcmp(key, "failed") == 0)
        return fault_number(key, value, 1000000, &f->rows_failed, error, size);
    return -1;
}

static int fault_field(struct fault *f, char *field, int *has_gpu, int *has_code, char *error,
                       size_t size)
{
    char *equals = strchr(field, '=');
    long long number = 0;
    long long *telemetry = NULL;
    unsigned long long high = 1000000;

    if (equals == NULL || equals == field) {
        snprintf(error, size, "expected key=value, got %s", field);
        return 0;
    }
    *equals = '\0';
    const char *key = field, *value = equals + 1;
    if (strcmp(key, "gpu") == 0 && f->kind != FAULT_INIT_FAIL && f->kind != FAULT_REBOOT) {
        if (!fault_number(key, value, UINT_MAX, &number, error, size))
            return 0;
        f->gpu = (unsigned int)number;
        *has_gpu = 1;
        return 1;
    }
    if (strcmp(key, "code") == 0 && f->kind == FAULT_XID) {
        if (!fault_number(key, value, UINT_MAX, &number, error, size))
            return 0;
        f->code = (unsigned long long)number;
        *has_code = 1;
        return 1;
    }
    if (strcmp(key, "mig") == 0 && f->kind == FAULT_XID)
        return fault_number(key, value, UINT_MAX, &f->mig, error, size);
    if (strcmp(key, "action") == 0 && f->kind == FAULT_XID)
        return fault_number(key, value, NVML_GPU_RECOVERY_ACTION_MAX, &f->action, error, size);
    int wear = wear_field(f, key, value, error, size);
    if (wear >= 0)
        return wear;
    if (f->kind == FAULT_TELEMETRY) {
        if (strcmp(key, "temperature_c") == 0)
            telemetry = &f->temperature_c;
        else if (strcmp(key, "power_w") == 0)
            telemetry = &f->power_w;
        else if (strcmp(key, "utilization") == 0) {
            telemetry = &f->utilization;
            high = 100;
        } else if (strcmp(key, "memory_used_mib") == 0) {
            telemetry = &f->memory_used_mib;
            high = 1ULL << 30;
        }
        if (telemetry != NULL)
            return fault_number(key, value, high, telemetry, error, size);
    }
    snprintf(error, size, "unknown key %s", key);
    return 0;
}

/* What clocks, pcie, remap and ecc_sbe lines need beyond gpu=. */
static int check_wear(const struct fault *f, const char *verb, char *error, size_t size)
{
    const struct nvmlDevice_st *gpu = &gpus[f->gpu];
    const char *why = NULL;
    if (f->kind == FAULT_ECC_SBE && f->count < 1)
        why = "count must be at least 1";
    else if (f->kind == FAULT_CLOCKS && !f->has_reasons)
        why = "needs reasons=";
    else if (f->kind == FAULT_PCIE && f->pcie_gen == UNSET && f->pcie_width == UNSET)
        why = "needs gen= or width=";
    else if (f->kind == FAULT_PCIE && f->pcie_gen != UNSET &&
             (f->pcie_gen < 1 || f->pcie_gen > gpu->pcie_gen_max))
        why = "gen must be between 1 and the GPU's pcie_gen_max";
    else if (f->kind == FAULT_PCIE && f->pcie_width != UNSET &&
             (f->pcie_width < 1 || f->pcie_width > gpu->pcie_width_max))
        why = "width must be between 1 and the GPU's pcie_width_max";
    else if (f->kind == FAULT_REMAP && f->rows_pending == UNSET && f->rows_failed == UNSET)
        why = "needs pending= or failed=";
    if (why != NULL)
        snprintf(error, size, "%s on GPU %u: %s", verb, f->gpu, why);
    return why == NULL;
}

/* One line, split in place: 1 with `f` filled, 0 for a blank or comment line, -1 when it is
 * malformed (`error` says why). */
static int parse_fault(char *line, struct fault *f, char *error, size_t size)
{
    char *save = NULL, *field;
    char *verb = strtok_r(line, " \t\r", &save);
    int known = 0, has_gpu = 0, has_code = 0, has_on = 0;

    if (verb == NULL || verb[0] == '#')
        return 0;
    memset(f, 0, sizeof *f);
    f->mig = f->action = f->temperature_c = f->power_w = f->utilization = f->memory_used_mib =
        f->pcie_gen = f->pcie_width = f->rows_pending = f->rows_failed = UNSET;
    f->count = 1;
    for (size_t i = 0; i < sizeof fault_verbs / sizeof fault_verbs[0]; i++)
        if (strcmp(verb, fault_verbs[i].verb) == 0) {
            f->kind = fault_verbs[i].kind;
            known = 1;
        }
    if (!known) {
        snprintf(error, size, "unknown fault %s", verb);
        return -1;
    }
    while ((field = strtok_r(NULL, " \t\r", &save)) != NULL) {
        if (f->kind == FAULT_INIT_FAIL && !has_on &&
            (strcmp(field, "on") == 0 || strcmp(field, "off") == 0)) {
            f->on = strcmp(field, "on") == 0;
            has_on = 1;
        } else if (!fault_field(f, field, &has_gpu, &has_code, error, size)) {
            return -1;
        }
    }
    if (f->kind == FAULT_INIT_FAIL) {
        if (!has_on)
            snprintf(error, size, "init_fail needs on or off");
        return has_on ? 1 : -1;
    }
    if (f->kind == FAULT_REBOOT) {
        if (has_gpu)
            snprintf(error, size, "reboot takes no fields");
        return has_gpu ? -1 : 1;
    }
    if (!has_gpu || (f->kind == FAULT_XID && !has_code)) {
        snprintf(error, size, "%s needs %s", verb, has_gpu ? "code=" : "gpu=");
        return -1;
    }
    if (f->gpu >= gpu_count) {
        snprintf(error, size, "no GPU %u", f->gpu);
        return -1;
    }
    if (f->mig != UNSET && (unsigned long long)f->mig >= gpus[f->gpu].mig_count) {
        snprintf(error, size, "GPU %u has no MIG device %lld", f->gpu, f->mig);
        return -1;
    }
    return check_wear(f, verb, error, size) ? 1 : -1;
}

/* The next complete line from the stream, which stands at `*offset`; the offset moves past it.
 * A last line without its newline is not complete yet: it is read once its writer is done. */
static int next_line(FILE *file, off_t *offset, char **line, size_t *capacity)
{
    ssize_t length = getline(line, capacity, file);
    if (length <= 0 || (*line)[length - 1] != '\n')
        return 0;
    (*line)[length - 1] = '\0';
    *offset += length;
    return 1;
}

static off_t faults_size(void)
{
    struct stat st;
    return stat(faults_file, &st) == 0 ? st.st_size : 0;
}

/* A reboot outranks a reset: a later GPU_RESET never hides a pending NODE_REBOOT. */
static void need_action(struct nvmlDevice_st *gpu, unsigned int action)
{
    if (get_uint(&gpu->recovery_action) != NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)
        set_uint(&gpu->recovery_action, action);
}

static void apply_fault(const struct fault *f)
{
    struct nvmlDevice_st *gpu = &gpus[f->gpu];
    switch (f->kind) {
    case FAULT_XID:
        if (f->action != UNSET)
            need_action(gpu, (unsigned int)f->action);
        break;
    case FAULT_ECC_DBE:
        __atomic_add_fetch(&gpu->ecc_uncorrected, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&gpu->ecc_uncorrected_volatile, 1, __ATOMIC_RELAXED);
        need_action(gpu, NVML_GPU_RECOVERY_ACTION_GPU_RESET);
        break;
    case FAULT_ECC_SBE:
        __atomic_add_fetch(&gpu->ecc_corrected, (unsigned long long)f->count, __ATOMIC_RELAXED);
        __atomic_add_fetch(&gpu->ecc_corrected_volatile, (unsigned long long)f->count,
                           __ATOMIC_RELAXED);
        break;
    case FAULT_LOST:
        set_int(&gpu->lost, 1);
        set_uint(&gpu->recovery_action, NVML_GPU_RECOVERY_ACTION_NODE_REBOOT);
        break;
    case FAULT_RECOVER:
        set_int(&gpu->lost, 0);
        break;
    case FAULT_RESET:
        if (!get_int(&gpu->lost) &&
            get_uint(&gpu->recovery_action) != NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)
            after_reset(gpu);
        break;
    case FAULT_REBOOT:
        for (unsigned int i = 0; i < gpu_count; i++) {
            set_int(&gpus[i].lost, gpus[i].base_lost);
            after_reset(&gpus[i]);
        }
        set_int(&init_failing, 0);
        break;
    case FAULT_INIT_FAIL:
        set_int(&init_failing, f->on);
        break;
    case FAULT_TELEMETRY:
        if (f->temperature_c != UNSET)
            set_uint(&gpu->temperature_c, (unsigned int)f->temperature_c);
        if (f->power_w != UNSET)
            set_uint(&gpu->power_usage_mw, (unsigned int)f->power_w * 1000);
        if (f->utilization != UNSET) {
            set_uint(&gpu->utilization_gpu, (unsigned int)f->utilization);
            set_uint(&gpu->utilization_memory, (unsigned int)f->utilization / 2);
        }
        if (f->memory_used_mib != UNSET)
            set_ull(&gpu->memory_used_mib, (unsigned long long)f->memory_used_mib);
        break;
    case FAULT_CLOCKS:
        set_ull(&gpu->clock_reasons, f->reasons);
        break;
    case FAULT_PCIE:
        if (f->pcie_gen != UNSET)
            set_uint(&gpu->pcie_gen, (unsigned int)f->pcie_gen);
        if (f->pcie_width != UNSET)
            set_uint(&gpu->pcie_width, (unsigned int)f->pcie_width);
        break;
    case FAULT_REMAP:
        if (f->rows_pending != UNSET)
            set_uint(&gpu->rows_pending, (unsigned int)f->rows_pending);
        if (f->rows_failed != UNSET)
            set_uint(&gpu->rows_failed, (unsigned int)f->rows_failed);
        break;
    }
}

/* Fold the lines appended since the last call into the device table; fault_lock is held. */
static void fold_faults_locked(void)
{
    off_t size = faults_size(), offset = faults_applied;
    char *line = NULL, error[256];
    size_t capacity = 0;
    struct fault f;
    FILE *file;

    if (size < offset) { /* replaced or truncated: fold the new file from its start */
        for (unsigned int i = 0; i < gpu_count; i++)
            reset_dynamic(&gpus[i]);
        set_int(&init_failing, 0);
        offset = 0;
    }
    if (size > offset && (file = fopen(faults_file, "r")) != NULL) {
        if (fseeko(file, offset, SEEK_SET) == 0)
            while (next_line(file, &offset, &line, &capacity)) {
                int parsed = parse_fault(line, &f, error, sizeof error);
                if (parsed > 0)
                    apply_fault(&f);
                else if (parsed < 0)
                    fprintf(stderr, "fake libnvidia-ml: %s: line skipped: %s\n", faults_file,
                            error);
            }
        free(line);
        fclose(file);
    }
    __atomic_store_n(&faults_applied, offset, __ATOMIC_RELEASE);
}

/* Bring the device table up to date with the fault file: one stat() when nothing changed. */
static void sync_faults(void)
{
    if (faults_size() == __atomic_load_n(&faults_applied, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&fault_lock);
    fold_faults_locked();
    pthread_mutex_unlock(&fault_lock);
}

/* The whole file, from scratch (first nvmlInit of the process). */
static nvmlReturn_t load_faults(char *error, size_t error_size)
{
    char *slash;
    nvmlReturn_t ret = sibling_path(".faults", faults_file, sizeof faults_file, error, error_size);
    if (ret != NVML_SUCCESS)
        return ret;
    memcpy(faults_dir, faults_file, sizeof faults_dir);
    slash = strrchr(faults_dir, '/');
    if (slash != NULL)
        slash[slash == faults_dir ? 1 : 0] = '\0';
    pthread_mutex_lock(&fault_lock);
    set_int(&init_failing, 0);
    faults_applied = 0;
    fold_faults_locked();
    pthread_mutex_unlock(&fault_lock);
    return NVML_SUCCESS;
}

/* ---- Lifecycle --------------------------------------------------------------------------- */

/* Aliases call static functions, never exported ones, so that no other library's NVML symbol
 * can interpose on calls inside this one. */
static nvmlReturn_t init(void)
{
    char path[PATH_MAX + 8], error[PATH_MAX + 256];
    nvmlReturn_t ret = NVML_SUCCESS;
    pthread_mutex_lock(&init_lock);
    if (init_count == 0) {
        ret = sibling_path(".sim", path, sizeof path, error, sizeof error);
        if (ret == NVML_SUCCESS)
            ret = load_data(path, error, sizeof error);
        if (ret == NVML_SUCCESS)
            ret = load_faults(error, sizeof error);
        if (ret != NVML_SUCCESS)
            fprintf(stderr, "fake libnvidia-ml: %s\n", error);
    } else {
        sync_faults();
    }
    /* Unlike real NVML, a nested nvmlInit fails too: every caller sees the driver gone. */
    if (ret == NVML_SUCCESS && get_int(&init_failing))
        ret = NVML_ERROR_DRIVER_NOT_LOADED;
    if (ret == NVML_SUCCESS)
        __atomic_add_fetch(&init_count, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&init_lock);
    return ret;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    return init();
}

nvmlReturn_t nvmlInit_v2(void)
{
    return init();
}

nvmlReturn_t nvmlInit(void)
{
    return init();
}

nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t ret = NVML_SUCCESS;
    pthread_mutex_lock(&init_lock);
    if (init_count == 0)
        ret = NVML_ERROR_UNINITIALIZED;
    else
        __atomic_sub_fetch(&init_count, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&init_lock);
    return ret;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

/* ---- System ------------------------------------------------------------------------------ */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    return copy_text(version, length, driver_version);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    return copy_text(version, length, nvml_version);
}

static nvmlReturn_t cuda_version(int *version)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (version == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *version = cuda_driver_version;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version)
{
    return cuda_version(version);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version)
{
    return cuda_version(version);
}

/* ---- Device identity --------------------------------------------------------------------- */

static nvmlReturn_t device_count(unsigned int *count)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = gpu_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    return device_count(count);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count)
{
    return device_count(count);
}

static nvmlReturn_t handle_by_index(unsigned int index, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || index >= gpu_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpus[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    return handle_by_index(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return handle_by_index(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (uuid == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < gpu_count; i++)
        if (strcmp(gpus[i].uuid, uuid) == 0) {
            *device = &gpus[i];
            return NVML_SUCCESS;
        }
    for (unsigned int i = 0; i < mig_total; i++)
        if (strcmp(migs[i].uuid, uuid) == 0) {
            *device = &migs[i];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

static nvmlReturn_t handle_by_pci(const char *bus_id, nvmlDevice_t *device)
{
    struct pci_address wanted;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (bus_id == NULL || device == NULL || !parse_pci(bus_id, &wanted))
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < gpu_count; i++)
        if (same_pci(&gpus[i].pci, &wanted)) {
            *device = &gpus[i];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus_id, nvmlDevice_t *device)
{
    return handle_by_pci(bus_id, device);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *bus_id, nvmlDevice_t *device)
{
    return handle_by_pci(bus_id, device);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup(device, &d);
    return ret != NVML_SUCCESS ? ret : copy_text(name, length, d->name);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup(device, &d);
    return ret != NVML_SUCCESS ? ret : copy_text(uuid, length, d->uuid);
}

nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && d->serial[0] == '\0')
        ret = NVML_ERROR_NOT_SUPPORTED;
    return ret != NVML_SUCCESS ? ret : copy_text(serial, length, d->serial);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && index == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *index = d->index;
    return ret;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && minor == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *minor = d->minor;
    return ret;
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup(device, &d);
    if (ret == NVML_SUCCESS && (major == NULL || minor == NULL))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) {
        *major = physical(d)->cc_major;
        *minor = physical(d)->cc_minor;
    }
    return ret;
}

nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *architecture)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup(device, &d);
    if (ret == NVML_SUCCESS && architecture == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *architecture = physical(d)->architecture;
    return ret;
}

nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, unsigned int *brand)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup(device, &d);
    if (ret == NVML_SUCCESS && brand == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *brand = physical(d)->brand;
    return ret;
}

/* ---- Memory and PCI ---------------------------------------------------------------------- */

/* Memory the driver keeps for itself; real GPUs show a few hundred MiB in use when idle. */
static unsigned long long reserved_bytes(const struct nvmlDevice_st *d)
{
    return (d->memory_mib / 160) << 20;
}

/* What applications use (the fault file's telemetry), within what the driver leaves them. */
static unsigned long long used_bytes(const struct nvmlDevice_st *d)
{
    unsigned long long used = get_ull(&d->memory_used_mib) << 20;
    unsigned long long room = (d->memory_mib << 20) - reserved_bytes(d);
    return used < room ? used : room;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup(device, &d);
    if (ret == NVML_SUCCESS && memory == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) {
        memory->total = d->memory_mib << 20;
        memory->used = reserved_bytes(d) + used_bytes(d);
        memory->free = memory->total - memory->used;
    }
    return ret;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup(device, &d);
    if (ret == NVML_SUCCESS && memory == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && memory->version != NVML_MEMORY_V2)
        ret = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (ret == NVML_SUCCESS) {
        memory->total = d->memory_mib << 20;
        memory->reserved = reserved_bytes(d);
        memory->used = used_bytes(d);
        memory->free = memory->total - memory->reserved - memory->used;
    }
    return ret;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && pci == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        fill_pci_info(&d->pci, pci);
    return ret;
}

enum pcie_figure { PCIE_GEN, PCIE_GEN_MAX, PCIE_WIDTH, PCIE_WIDTH_MAX };

/* One figure of a whole GPU's PCIe link (MIG devices do not answer, as in NVML). */
static nvmlReturn_t pcie_link(nvmlDevice_t device, enum pcie_figure figure, unsigned int *out)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && out == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret != NVML_SUCCESS)
        return ret;
    switch (figure) {
    case PCIE_GEN: *out = get_uint(&d->pcie_gen); break;
    case PCIE_GEN_MAX: *out = d->pcie_gen_max; break;
    case PCIE_WIDTH: *out = get_uint(&d->pcie_width); break;
    case PCIE_WIDTH_MAX: *out = d->pcie_width_max; break;
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t device, unsigned int *gen)
{
    return pcie_link(device, PCIE_GEN, gen);
}

/* The fastest the link can train at with this GPU in this slot. */
nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t device, unsigned int *gen)
{
    return pcie_link(device, PCIE_GEN_MAX, gen);
}

/* The GPU's own maximum: the same, as no simulated slot holds a GPU back. */
nvmlReturn_t nvmlDeviceGetGpuMaxPcieLinkGeneration(nvmlDevice_t device, unsigned int *gen)
{
    return pcie_link(device, PCIE_GEN_MAX, gen);
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t device, unsigned int *width)
{
    return pcie_link(device, PCIE_WIDTH, width);
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t device, unsigned int *width)
{
    return pcie_link(device, PCIE_WIDTH_MAX, width);
}

/* ---- MIG --------------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && (current == NULL || pending == NULL))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && d->mig_mode == MIG_UNSUPPORTED)
        ret = NVML_ERROR_NOT_SUPPORTED;
    if (ret == NVML_SUCCESS)
        *current = *pending =
            d->mig_mode == MIG_ENABLED ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    return ret;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && count == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && d->mig_mode == MIG_UNSUPPORTED)
        ret = NVML_ERROR_NOT_SUPPORTED;
    if (ret == NVML_SUCCESS)
        *count = MAX_MIGS_PER_GPU;
    return ret;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                 nvmlDevice_t *mig)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret != NVML_SUCCESS)
        return ret == NVML_ERROR_NOT_SUPPORTED ? NVML_ERROR_INVALID_ARGUMENT : ret;
    if (mig == NULL || index >= MAX_MIGS_PER_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (d->mig_mode == MIG_UNSUPPORTED)
        return NVML_ERROR_NOT_SUPPORTED;
    if (index >= d->mig_count)
        return NVML_ERROR_NOT_FOUND;
    *mig = d->migs[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t mig, nvmlDevice_t *device)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup(mig, &d);
    if (ret == NVML_SUCCESS && (device == NULL || !d->is_mig))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *device = d->parent;
    return ret;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *is_mig)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup(device, &d);
    if (ret == NVML_SUCCESS && is_mig == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *is_mig = (unsigned int)d->is_mig;
    return ret;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup(device, &d);
    if (ret == NVML_SUCCESS && (id == NULL || !d->is_mig))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *id = d->gpu_instance_id;
    return ret;
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup(device, &d);
    if (ret == NVML_SUCCESS && (id == NULL || !d->is_mig))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *id = d->compute_instance_id;
    return ret;
}

/* ---- MIG GPU and compute instances ------------------------------------------------------- */

/* Each simulated MIG device is one GPU instance holding one compute instance that spans it, as
 * `nvidia-smi mig -cgi <profile> -C` makes them. Profile ids follow nvml.h: the slice count of
 * an instance decides it. NVIDIA's device plugin (through go-nvlib) reads these to name MIG
 * resources (nvidia.com/mig-3g.40gb) under the mixed strategy. */

#define NVML_GPU_INSTANCE_PROFILE_COUNT 0x11
#define NVML_COMPUTE_INSTANCE_PROFILE_COUNT 0x8
#define NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT 0x1
#define SLICES_PER_GPU 7
#define SMS_PER_SLICE 14 /* an A100's 98 SMs over 7 slices */

typedef struct {
    unsigned int start;
    unsigned int size;
} nvmlPlacement_t; /* nvmlGpuInstancePlacement_t and nvmlComputeInstancePlacement_t alike */

typedef struct {
    unsigned int id;
    unsigned int isP2pSupported;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
} nvmlGpuInstanceProfileInfo_t;

typedef struct {
    unsigned int id;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
} nvmlComputeInstanceProfileInfo_t;

typedef struct {
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    unsigned int gpuInstanceSliceCount;
    unsigned int computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

/* Handles: one GPU instance and one compute instance per MIG device, at the same index as the
 * device in `migs`. */
struct nvmlGpuInstance_st {
    int unused;
};
struct nvmlComputeInstance_st {
    int unused;
};
typedef struct nvmlGpuInstance_st *nvmlGpuInstance_t;
typedef struct nvmlComputeInstance_st *nvmlComputeInstance_t;
static struct nvmlGpuInstance_st gpu_instances[MAX_GPUS * MAX_MIGS_PER_GPU];
static struct nvmlComputeInstance_st compute_instances[MAX_GPUS * MAX_MIGS_PER_GPU];

typedef struct {
    nvmlDevice_t device;
    unsigned int id;
    unsigned int profileId;
    nvmlPlacement_t placement;
} nvmlGpuInstanceInfo_t;

typedef struct {
    nvmlDevice_t device;
    nvmlGpuInstance_t gpuInstance;
    unsigned int id;
    unsigned int profileId;
    nvmlPlacement_t placement;
} nvmlComputeInstanceInfo_t;

/* nvml.h's profile id for an instance of `slices` slices (GPU and compute profiles agree on
 * these), or -1. */
static int profile_of_slices(unsigned int slices)
{
    static const unsigned int by_id[] = {1, 2, 3, 4, 7, 8, 6};
    for (unsigned int id = 0; id < sizeof by_id / sizeof by_id[0]; id++)
        if (by_id[id] == slices)
            return (int)id;
    return -1;
}

static unsigned int slices_of_profile(unsigned int profile)
{
    static const unsigned int by_id[] = {1, 2, 3, 4, 7, 8, 6};
    return profile < sizeof by_id / sizeof by_id[0] ? by_id[profile] : 0;
}

/* "... MIG 3g.40gb" has 3 slices; a name without it falls back on the memory share. */
static unsigned int mig_slices(const struct nvmlDevice_st *mig)
{
    const char *at = strstr(mig->name, "MIG ");
    unsigned int slices = 0;
    char g = 0;
    if (at != NULL && sscanf(at + 4, "%u%c", &slices, &g) == 2 && g == 'g' && slices >= 1 &&
        slices <= SLICES_PER_GPU)
        return slices;
    slices = (unsigned int)((mig->memory_mib * 8 + mig->parent->memory_mib - 1) /
                            mig->parent->memory_mib);
    return slices < 1 ? 1 : slices > SLICES_PER_GPU ? SLICES_PER_GPU : slices;
}

/* The first slice of a MIG device: its earlier siblings are packed before it. */
static unsigned int mig_start(const struct nvmlDevice_st *mig)
{
    unsigned int start = 0;
    for (unsigned int i = 0; i < mig->index; i++)
        start += mig_slices(mig->parent->migs[i]);
    return start;
}

static unsigned int mig_table_index(const struct nvmlDevice_st *mig)
{
    return (unsigned int)(mig - migs);
}

/* The MIG device behind a GPU or compute instance handle of a GPU still on the bus. */
static nvmlReturn_t lookup_instance(const void *handle, const void *table, size_t size,
                                    struct nvmlDevice_st **out)
{
    uintptr_t at = (uintptr_t)handle, first = (uintptr_t)table;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (at < first || at >= first + mig_total * size || (at - first) % size)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = &migs[(at - first) / size];
    sync_faults();
    return get_int(&(*out)->parent->lost) ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

/* A GPU in MIG mode, for the instance queries. */
static nvmlReturn_t lookup_mig_gpu(nvmlDevice_t device, struct nvmlDevice_st **out)
{
    nvmlReturn_t ret = lookup_gpu(device, out);
    if (ret == NVML_SUCCESS && (*out)->mig_mode == MIG_UNSUPPORTED)
        ret = NVML_ERROR_NOT_SUPPORTED;
    return ret;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                 nvmlGpuInstanceProfileInfo_t *info)
{
    struct nvmlDevice_st *d;
    unsigned int slices = slices_of_profile(profile);
    nvmlReturn_t ret = lookup_mig_gpu(device, &d);
    if (ret == NVML_SUCCESS && (info == NULL || profile >= NVML_GPU_INSTANCE_PROFILE_COUNT))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && (slices == 0 || slices > SLICES_PER_GPU || slices == 6))
        ret = NVML_ERROR_NOT_SUPPORTED; /* a 7-slice GPU has no 6- or 8-slice instances */
    if (ret != NVML_SUCCESS)
        return ret;
    memset(info, 0, sizeof *info);
    info->id = profile;
    info->isP2pSupported = 0;
    info->sliceCount = slices;
    info->instanceCount = slices == 3 ? 2 : SLICES_PER_GPU / slices;
    info->multiprocessorCount = slices * SMS_PER_SLICE;
    info->copyEngineCount = slices;
    info->decoderCount = slices / 2;
    info->jpegCount = slices == SLICES_PER_GPU;
    info->ofaCount = slices == SLICES_PER_GPU;
    /* An existing instance of the profile tells its size; else an eighth of memory a slice. */
    info->memorySizeMB = d->memory_mib * (slices == SLICES_PER_GPU ? 8 : slices) / 8;
    for (unsigned int i = 0; i < d->mig_count; i++)
        if (mig_slices(d->migs[i]) == slices)
            info->memorySizeMB = d->migs[i]->memory_mib;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                          nvmlGpuInstance_t *instance)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_mig_gpu(device, &d);
    if (ret == NVML_SUCCESS && instance == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret != NVML_SUCCESS)
        return ret;
    for (unsigned int i = 0; i < d->mig_count; i++)
        if (d->migs[i]->gpu_instance_id == id) {
            *instance = &gpu_instances[mig_table_index(d->migs[i])];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t instance, nvmlGpuInstanceInfo_t *info)
{
    struct nvmlDevice_st *mig;
    nvmlReturn_t ret = lookup_instance(instance, gpu_instances, sizeof *gpu_instances, &mig);
    if (ret == NVML_SUCCESS && info == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret != NVML_SUCCESS)
        return ret;
    info->device = mig->parent;
    info->id = mig->gpu_instance_id;
    info->profileId = (unsigned int)profile_of_slices(mig_slices(mig));
    info->placement.start = mig_start(mig);
    info->placement.size = mig_slices(mig);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t instance,
                                                          unsigned int profile,
                                                          unsigned int engine_profile,
                                                          nvmlComputeInstanceProfileInfo_t *info)
{
    struct nvmlDevice_st *mig;
    unsigned int slices = slices_of_profile(profile), gpu_slices;
    nvmlReturn_t ret = lookup_instance(instance, gpu_instances, sizeof *gpu_instances, &mig);
    if (ret == NVML_SUCCESS &&
        (info == NULL || profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT ||
         engine_profile >= NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret != NVML_SUCCESS)
        return ret;
    gpu_slices = mig_slices(mig);
    if (slices == 0 || slices > gpu_slices)
        return NVML_ERROR_NOT_SUPPORTED;
    memset(info, 0, sizeof *info);
    info->id = profile;
    info->sliceCount = slices;
    info->instanceCount = gpu_slices / slices;
    info->multiprocessorCount = slices * SMS_PER_SLICE;
    info->sharedCopyEngineCount = gpu_slices;
    info->sharedDecoderCount = gpu_slices / 2;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t instance, unsigned int id,
                                                   nvmlComputeInstance_t *compute)
{
    struct nvmlDevice_st *mig;
    nvmlReturn_t ret = lookup_instance(instance, gpu_instances, sizeof *gpu_instances, &mig);
    if (ret == NVML_SUCCESS && compute == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && id != mig->compute_instance_id)
        ret = NVML_ERROR_NOT_FOUND;
    if (ret == NVML_SUCCESS)
        *compute = &compute_instances[mig_table_index(mig)];
    return ret;
}

static nvmlReturn_t compute_instance_info(nvmlComputeInstance_t compute,
                                          nvmlComputeInstanceInfo_t *info)
{
    struct nvmlDevice_st *mig;
    nvmlReturn_t ret =
        lookup_instance(compute, compute_instances, sizeof *compute_instances, &mig);
    if (ret == NVML_SUCCESS && info == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret != NVML_SUCCESS)
        return ret;
    info->device = mig->parent;
    info->gpuInstance = &gpu_instances[mig_table_index(mig)];
    info->id = mig->compute_instance_id;
    info->profileId = (unsigned int)profile_of_slices(mig_slices(mig));
    info->placement.start = 0;
    info->placement.size = mig_slices(mig);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t compute,
                                           nvmlComputeInstanceInfo_t *info)
{
    return compute_instance_info(compute, info);
}

nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t compute,
                                        nvmlComputeInstanceInfo_t *info)
{
    return compute_instance_info(compute, info);
}

/* As in NVML, only MIG device handles have attributes. */
static nvmlReturn_t device_attributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup(device, &d);
    if (ret == NVML_SUCCESS && attributes == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && !d->is_mig)
        ret = NVML_ERROR_NOT_SUPPORTED;
    if (ret != NVML_SUCCESS)
        return ret;
    unsigned int slices = mig_slices(d);
    memset(attributes, 0, sizeof *attributes);
    attributes->multiprocessorCount = slices * SMS_PER_SLICE;
    attributes->sharedCopyEngineCount = slices;
    attributes->sharedDecoderCount = slices / 2;
    attributes->gpuInstanceSliceCount = slices;
    attributes->computeInstanceSliceCount = slices;
    attributes->memorySizeMB = d->memory_mib;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    return device_attributes(device, attributes);
}

nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    return device_attributes(device, attributes);
}

/* ---- NVLink and topology ----------------------------------------------------------------- */

static nvmlReturn_t lookup_link(nvmlDevice_t device, unsigned int link, struct nvlink **out)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (d->nvlink_count == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (link >= d->nvlink_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = &d->nvlinks[link];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
                                      unsigned int *is_active)
{
    struct nvlink *l;
    nvmlReturn_t ret = lookup_link(device, link, &l);
    if (ret == NVML_SUCCESS && is_active == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *is_active = l->active ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return ret;
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link,
                                                 nvmlPciInfo_t *pci)
{
    struct nvlink *l;
    nvmlReturn_t ret = lookup_link(device, link, &l);
    if (ret == NVML_SUCCESS && pci == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && !l->active)
        ret = NVML_ERROR_NOT_SUPPORTED;
    if (ret == NVML_SUCCESS)
        fill_pci_info(&l->remote, pci);
    return ret;
}

/* The simulation knows NUMA placement only: same NUMA node means "same CPU", else "system". */
nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                 unsigned int *level)
{
    struct nvmlDevice_st *a, *b;
    nvmlReturn_t ret = lookup_gpu(device1, &a);
    if (ret == NVML_SUCCESS)
        ret = lookup_gpu(device2, &b);
    if (ret == NVML_SUCCESS && level == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret != NVML_SUCCESS)
        return ret;
    if (a == b)
        *level = NVML_TOPOLOGY_INTERNAL;
    else if (a->numa_node == b->numa_node)
        *level = NVML_TOPOLOGY_NODE;
    else
        *level = NVML_TOPOLOGY_SYSTEM;
    return NVML_SUCCESS;
}

/* The CPUs near a GPU, as the driver takes them from its PCI device's local CPU list; NUMA and
 * socket scope are the same set here, as the simulation has one NUMA node per socket. */
static nvmlReturn_t cpu_affinity(nvmlDevice_t device, unsigned int size, unsigned long *set)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && (set == NULL || size == 0))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && !d->has_cpus)
        ret = NVML_ERROR_NOT_SUPPORTED;
    if (ret != NVML_SUCCESS)
        return ret;
    for (unsigned int i = 0; i < size; i++)
        set[i] = i < CPU_WORDS ? d->cpus[i] : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize,
                                      unsigned long *cpuSet)
{
    return cpu_affinity(device, cpuSetSize, cpuSet);
}

nvmlReturn_t nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t device, unsigned int cpuSetSize,
                                                 unsigned long *cpuSet, nvmlAffinityScope_t scope)
{
    if (scope != NVML_AFFINITY_SCOPE_NODE && scope != NVML_AFFINITY_SCOPE_SOCKET)
        return NVML_ERROR_INVALID_ARGUMENT;
    return cpu_affinity(device, cpuSetSize, cpuSet);
}

/* The NUMA nodes whose memory is nearest: the GPU's own node (both scopes, as above). */
nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t device, unsigned int nodeSetSize,
                                         unsigned long *nodeSet, nvmlAffinityScope_t scope)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && (nodeSet == NULL || nodeSetSize == 0 ||
                                (scope != NVML_AFFINITY_SCOPE_NODE &&
                                 scope != NVML_AFFINITY_SCOPE_SOCKET)))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && d->numa_node < 0)
        ret = NVML_ERROR_NOT_SUPPORTED;
    if (ret != NVML_SUCCESS)
        return ret;
    memset(nodeSet, 0, nodeSetSize * sizeof *nodeSet);
    if ((unsigned int)d->numa_node / WORD_BITS < nodeSetSize)
        nodeSet[d->numa_node / WORD_BITS] = 1ul << (d->numa_node % WORD_BITS);
    return NVML_SUCCESS;
}

/* ---- Telemetry --------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensor,
                                      unsigned int *temperature)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && (temperature == NULL || sensor != NVML_TEMPERATURE_GPU))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *temperature = get_uint(&d->temperature_c);
    return ret;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *milliwatts)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && milliwatts == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *milliwatts = get_uint(&d->power_usage_mw);
    return ret;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *milliwatts)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && milliwatts == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && d->power_limit_mw == 0)
        ret = NVML_ERROR_NOT_SUPPORTED;
    if (ret == NVML_SUCCESS)
        *milliwatts = d->power_limit_mw;
    return ret;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && utilization == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) {
        utilization->gpu = get_uint(&d->utilization_gpu);
        utilization->memory = get_uint(&d->utilization_memory);
    }
    return ret;
}

static nvmlReturn_t clocks_event_reasons(nvmlDevice_t device, unsigned long long *reasons)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && reasons == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *reasons = get_ull(&d->clock_reasons);
    return ret;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                    unsigned long long *reasons)
{
    return clocks_event_reasons(device, reasons);
}

/* The name before NVML 12.2; the same answer. */
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                       unsigned long long *reasons)
{
    return clocks_event_reasons(device, reasons);
}

/* ---- ECC --------------------------------------------------------------------------------- */

/* Ampere and later GPUs remap rows instead of retiring pages. */
static int remaps_rows(const struct nvmlDevice_st *gpu)
{
    return gpu->architecture >= NVML_DEVICE_ARCH_AMPERE &&
           gpu->architecture != NVML_DEVICE_ARCH_UNKNOWN;
}

nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && (current == NULL || pending == NULL))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *current = *pending = NVML_FEATURE_ENABLED;
    return ret;
}

/* Aggregate counters are the fault file's whole history; volatile ones start again at a reset. */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, unsigned int error_type,
                                         unsigned int counter_type, unsigned long long *count)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS &&
        (count == NULL || counter_type > NVML_AGGREGATE_ECC ||
         (error_type != NVML_MEMORY_ERROR_TYPE_CORRECTED &&
          error_type != NVML_MEMORY_ERROR_TYPE_UNCORRECTED)))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *count = get_ull(counter_type == NVML_VOLATILE_ECC
                             ? (error_type == NVML_MEMORY_ERROR_TYPE_CORRECTED
                                    ? &d->ecc_corrected_volatile
                                    : &d->ecc_uncorrected_volatile)
                             : (error_type == NVML_MEMORY_ERROR_TYPE_CORRECTED
                                    ? &d->ecc_corrected
                                    : &d->ecc_uncorrected));
    return ret;
}

/* One retired page per double-bit error, on GPUs before Ampere. */
nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, unsigned int cause,
                                       unsigned int *count, unsigned long long *addresses)
{
    struct nvmlDevice_st *d;
    unsigned int pages = 0;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && (count == NULL || cause > 1))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && remaps_rows(d))
        ret = NVML_ERROR_NOT_SUPPORTED;
    if (ret != NVML_SUCCESS)
        return ret;
    if (cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR) {
        unsigned long long dbe = get_ull(&d->ecc_uncorrected);
        pages = dbe > 64 ? 64 : (unsigned int)dbe;
    }
    if (*count < pages || (pages > 0 && addresses == NULL)) {
        *count = pages;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < pages; i++)
        addresses[i] = 0x100000ull * (i + 1) + d->index;
    *count = pages;
    return NVML_SUCCESS;
}

/* One remapped row per double-bit error on Ampere and later, pending until the GPU is reset, and
 * the rows of remap lines. isPending and failureOccurred are flags, as in NVML. */
nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrected,
                                       unsigned int *uncorrected, unsigned int *pending,
                                       unsigned int *failed)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS &&
        (corrected == NULL || uncorrected == NULL || pending == NULL || failed == NULL))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && !remaps_rows(d))
        ret = NVML_ERROR_NOT_SUPPORTED;
    if (ret == NVML_SUCCESS) {
        unsigned long long rows = get_ull(&d->ecc_uncorrected) + get_ull(&d->rows_remapped) +
                                  get_uint(&d->rows_pending);
        *corrected = 0;
        *uncorrected = rows > UINT_MAX ? UINT_MAX : (unsigned int)rows;
        *pending = get_ull(&d->ecc_uncorrected_volatile) > 0 || get_uint(&d->rows_pending) > 0;
        *failed = get_uint(&d->rows_failed) > 0;
    }
    return ret;
}

/* ---- Field values ------------------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int count, nvmlFieldValue_t *values)
{
    struct nvmlDevice_st *d;
    struct timespec now;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && (count < 0 || (count > 0 && values == NULL)))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret != NVML_SUCCESS)
        return ret;
    clock_gettime(CLOCK_REALTIME, &now);
    for (int i = 0; i < count; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = (long long)now.tv_sec * 1000000 + now.tv_nsec / 1000;
        v->latencyUsec = 0;
        if (v->fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            v->value.ullVal = 0;
            v->value.uiVal = get_uint(&d->recovery_action);
            v->nvmlReturn = NVML_SUCCESS;
        } else {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}

/* ---- Events ------------------------------------------------------------------------------ */

#define EVENT_SET_MAGIC 0x45564e54u

struct nvmlEventSet_st {
    unsigned int magic;
    int notify_fd;                       /* inotify watch of the fault file's directory */
    off_t offset;                        /* the next fault-file byte this set reads */
    unsigned long long masks[MAX_GPUS];  /* registered event types, by GPU index */
};

typedef struct nvmlEventSet_st *nvmlEventSet_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef struct { /* before NVML 11: no instance ids */
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
} nvmlEventData_v1_t;

static int valid_set(const struct nvmlEventSet_st *set)
{
    return set != NULL && set->magic == EVENT_SET_MAGIC;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *out)
{
    struct nvmlEventSet_st *set;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    set = calloc(1, sizeof *set);
    if (set == NULL)
        return NVML_ERROR_UNKNOWN;
    set->notify_fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    /* The directory, not the file: the file need not exist yet. */
    if (set->notify_fd < 0 ||
        inotify_add_watch(set->notify_fd, faults_dir, IN_MODIFY | IN_CREATE | IN_MOVED_TO) < 0) {
        fprintf(stderr, "fake libnvidia-ml: cannot watch %s: %s\n", faults_dir, strerror(errno));
        if (set->notify_fd >= 0)
            close(set->notify_fd);
        free(set);
        return NVML_ERROR_UNKNOWN;
    }
    /* Watch first, then take the end: a line appended in between wakes the set for nothing,
     * but no line appended later can be missed. */
    set->offset = faults_size();
    set->magic = EVENT_SET_MAGIC;
    *out = set;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!valid_set(set))
        return NVML_ERROR_INVALID_ARGUMENT;
    close(set->notify_fd);
    set->magic = 0;
    free(set);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && types == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *types = SUPPORTED_EVENTS;
    return ret;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types,
                                      nvmlEventSet_t set)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && !valid_set(set))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && (types & ~SUPPORTED_EVENTS) != 0)
        ret = NVML_ERROR_NOT_SUPPORTED;
    if (ret == NVML_SUCCESS)
        set->masks[d->index] |= types;
    return ret;
}

static int event_of(const struct nvmlEventSet_st *set, const struct fault *f,
                    nvmlEventData_t *out)
{
    unsigned long long type, data = 0;
    switch (f->kind) {
    case FAULT_XID:
        type = nvmlEventTypeXidCriticalError;
        data = f->code;
        break;
    case FAULT_LOST:
        type = nvmlEventTypeXidCriticalError;
        data = XID_GPU_FALLEN_OFF_THE_BUS;
        break;
    case FAULT_ECC_DBE:
        type = nvmlEventTypeDoubleBitEccError;
        break;
    case FAULT_ECC_SBE:
        type = nvmlEventTypeSingleBitEccError;
        break;
    default:
        return 0;
    }
    if ((set->masks[f->gpu] & type) == 0)
        return 0;
    out->device = &gpus[f->gpu];
    out->eventType = type;
    out->eventData = data;
    out->gpuInstanceId = out->computeInstanceId = NVML_VALUE_NOT_AVAILABLE;
    if (f->mig != UNSET) {
        const struct nvmlDevice_st *mig = gpus[f->gpu].migs[f->mig];
        out->gpuInstanceId = mig->gpu_instance_id;
        out->computeInstanceId = mig->compute_instance_id;
    }
    return 1;
}

/* The first event for `set` among the lines appended since it last looked, if any. */
static int next_event(struct nvmlEventSet_st *set, nvmlEventData_t *out)
{
    off_t size = faults_size();
    char *line = NULL, error[256];
    size_t capacity = 0;
    struct fault f;
    FILE *file;
    int found = 0;

    if (size < set->offset)
        set->offset = 0; /* replaced: every line of the new file is new */
    if (size == set->offset || (file = fopen(faults_file, "r")) == NULL)
        return 0;
    if (fseeko(file, set->offset, SEEK_SET) == 0)
        while (!found && next_line(file, &set->offset, &line, &capacity))
            found = parse_fault(line, &f, error, sizeof error) > 0 && event_of(set, &f, out);
    free(line);
    fclose(file);
    return found;
}

static long long now_ms(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec * 1000LL + now.tv_nsec / 1000000;
}

static void drain(int fd)
{
    char buffer[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    while (read(fd, buffer, sizeof buffer) > 0)
        continue;
}

static nvmlReturn_t wait_event(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms)
{
    long long deadline = now_ms() + timeout_ms;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!valid_set(set) || data == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (;;) {
        sync_faults();
        if (get_int(&init_failing))
            return NVML_ERROR_UNKNOWN;
        if (next_event(set, data))
            return NVML_SUCCESS;
        long long left = deadline - now_ms();
        if (left <= 0)
            return NVML_ERROR_TIMEOUT;
        struct pollfd watch = {.fd = set->notify_fd, .events = POLLIN};
        int ready = poll(&watch, 1, left > INT_MAX ? INT_MAX : (int)left);
        if (ready < 0 && errno != EINTR)
            return NVML_ERROR_UNKNOWN;
        if (ready > 0)
            drain(set->notify_fd);
    }
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms)
{
    return wait_event(set, data, timeout_ms);
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_v1_t *data, unsigned int timeout_ms)
{
    nvmlEventData_t full;
    nvmlReturn_t ret = NVML_ERROR_INVALID_ARGUMENT;
    if (data != NULL)
        ret = wait_event(set, &full, timeout_ms);
    if (ret == NVML_SUCCESS) {
        data->device = full.device;
        data->eventType = full.eventType;
        data->eventData = full.eventData;
    }
    return ret;
}
