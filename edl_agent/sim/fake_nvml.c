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
 * Layout of this file: NVML types, the device table, the data-file parser, then the API in
 * groups (lifecycle, system, device identity, memory/PCI, MIG, NVLink/topology, telemetry).
 * NVML events and fault injection are meant to join as further groups that update the
 * telemetry and health fields of the device table.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
#define NVML_DEVICE_ARCH_UNKNOWN 0xffffffffu
#define NVML_NVLINK_MAX_LINKS 36 /* nvml.h of CUDA 12.8+; older headers say 18 */
#define NVML_MEMORY_V2 0x02000028u /* sizeof(nvmlMemory_v2_t) | 2 << 24 */
#define PCI_VENDOR_NVIDIA 0x10deu

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
    unsigned int mig_count;
    struct nvmlDevice_st *migs[MAX_MIGS_PER_GPU];

    /* MIG devices */
    struct nvmlDevice_st *parent;
    unsigned int gpu_instance_id;
    unsigned int compute_instance_id;

    /* Telemetry: static values for now; metrics and fault injection will change them. */
    unsigned int temperature_c;
    unsigned int power_usage_mw;
    nvmlUtilization_t utilization;
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
    return physical(*out)->lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
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

static int parse_gpu(struct parser *p, const struct record *r)
{
    static const char *const keys[] = {
        "index", "uuid", "name", "memory_mib", "bus_id", "minor", "numa_node",
        "compute_capability", "architecture", "brand", "serial", "mig", "power_limit_w",
        "nvlinks", "lost", NULL};
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
        !get_unsigned(p, r, "lost", 0, 1, &lost))
        return 0;
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
    gpu->lost = (int)lost;
    gpu->power_limit_mw = power_w * 1000;
    gpu->power_usage_mw = gpu->power_limit_mw / 10;
    gpu->temperature_c = 33 + index % 4;
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

static nvmlReturn_t data_path(char *out, size_t size, char *error, size_t error_size)
{
    Dl_info info;
    char resolved[PATH_MAX];
    if (dladdr((void *)&data_path, &info) == 0 || info.dli_fname == NULL ||
        realpath(info.dli_fname, resolved) == NULL) {
        snprintf(error, error_size, "cannot locate the library's own file");
        return NVML_ERROR_UNKNOWN;
    }
    if ((size_t)snprintf(out, size, "%s.sim", resolved) >= size) {
        snprintf(error, error_size, "library path too long");
        return NVML_ERROR_UNKNOWN;
    }
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
        ret = data_path(path, sizeof path, error, sizeof error);
        if (ret == NVML_SUCCESS)
            ret = load_data(path, error, sizeof error);
        if (ret != NVML_SUCCESS)
            fprintf(stderr, "fake libnvidia-ml: %s\n", error);
    }
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

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup(device, &d);
    if (ret == NVML_SUCCESS && memory == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) {
        memory->total = d->memory_mib << 20;
        memory->used = reserved_bytes(d);
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
        memory->used = 0;
        memory->free = memory->total - memory->reserved;
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

/* ---- Telemetry --------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensor,
                                      unsigned int *temperature)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && (temperature == NULL || sensor != NVML_TEMPERATURE_GPU))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *temperature = d->temperature_c;
    return ret;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *milliwatts)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t ret = lookup_gpu(device, &d);
    if (ret == NVML_SUCCESS && milliwatts == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *milliwatts = d->power_usage_mw;
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
    if (ret == NVML_SUCCESS)
        *utilization = d->utilization;
    return ret;
}
