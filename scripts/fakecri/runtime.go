package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	apitest "k8s.io/cri-api/pkg/apis/testing"
	"k8s.io/cri-client/pkg/fake"
)

// runtime is the upstream fake with kubelet's needs met: the methods defined here replace the
// fake's, all others are the fake's own.
type runtime struct {
	*fake.RemoteRuntime
	logMu sync.Mutex
	log   *os.File
	exec  *execState // nil unless containers run as processes (exec mode)
}

func newRuntime(logPath, mountpoint string, execMode *execConfig) (*runtime, error) {
	// The fake gives every sandbox this address (default 192.168.192.168); pod IPs show in pod
	// status, so they must be addresses nobody could reach by mistake.
	apitest.FakePodSandboxIPs = []string{"127.0.0.1"}
	remote := fake.NewFakeRemoteRuntime()
	rs := remote.RuntimeService
	rs.FakeStatus = &runtimeapi.RuntimeStatus{Conditions: []*runtimeapi.RuntimeCondition{
		{Type: runtimeapi.RuntimeReady, Status: true},
		{Type: runtimeapi.NetworkReady, Status: true},
	}}
	rs.FakeLinuxConfiguration = &runtimeapi.LinuxRuntimeConfiguration{CgroupDriver: runtimeapi.CgroupDriver_CGROUPFS}
	// Kubelet rejects images whose size is 0 (ImageInspectError).
	remote.ImageService.SetFakeImageSize(1 << 20)
	// Kubelet looks the mountpoint up among the host's devices and complains every 10 s if absent.
	usage := []*runtimeapi.FilesystemUsage{{
		Timestamp:  time.Now().UnixNano(),
		FsId:       &runtimeapi.FilesystemIdentifier{Mountpoint: mountpoint},
		UsedBytes:  &runtimeapi.UInt64Value{Value: 1 << 20},
		InodesUsed: &runtimeapi.UInt64Value{Value: 1},
	}}
	remote.ImageService.SetFakeFilesystemUsage(usage)
	remote.ImageService.SetFakeContainerFilesystemUsage(usage)
	r := &runtime{RemoteRuntime: remote}
	if execMode != nil {
		state, err := newExecState(*execMode)
		if err != nil {
			return nil, err
		}
		r.exec = state
	}
	file, err := os.OpenFile(logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, fmt.Errorf("opening the CreateContainer log: %w", err)
	}
	r.log = file
	return r, nil
}

func (r *runtime) close() { _ = r.log.Close() }

// trimCallRecords empties the fakes' lists of calls now and then: they grow with every RPC and
// kubelet makes several a second.
func (r *runtime) trimCallRecords(done <-chan struct{}) {
	ticker := time.NewTicker(time.Minute)
	defer ticker.Stop()
	for {
		select {
		case <-done:
			return
		case <-ticker.C:
			r.RuntimeService.Lock()
			r.RuntimeService.Called = nil
			r.RuntimeService.Unlock()
			r.ImageService.Lock()
			r.ImageService.Called = nil
			r.ImageService.Unlock()
		}
	}
}

func (r *runtime) Version(context.Context, *runtimeapi.VersionRequest) (*runtimeapi.VersionResponse, error) {
	return &runtimeapi.VersionResponse{
		Version:           "0.1.0", // the only one kubelet accepts
		RuntimeName:       "edl-fake-cri",
		RuntimeVersion:    "1.0.0",
		RuntimeApiVersion: "v1",
	}, nil
}

// The fake answers a plain error for unknown ids; kubelet expects NotFound, which it ignores
// where a container or sandbox may vanish between a list and a status call.
func (r *runtime) ContainerStatus(ctx context.Context, req *runtimeapi.ContainerStatusRequest) (*runtimeapi.ContainerStatusResponse, error) {
	r.RuntimeService.Lock()
	_, ok := r.RuntimeService.Containers[req.ContainerId]
	r.RuntimeService.Unlock()
	if !ok {
		return nil, status.Errorf(codes.NotFound, "container %q not found", req.ContainerId)
	}
	return r.RemoteRuntime.ContainerStatus(ctx, req)
}

func (r *runtime) PodSandboxStatus(ctx context.Context, req *runtimeapi.PodSandboxStatusRequest) (*runtimeapi.PodSandboxStatusResponse, error) {
	r.RuntimeService.Lock()
	_, ok := r.RuntimeService.Sandboxes[req.PodSandboxId]
	r.RuntimeService.Unlock()
	if !ok {
		return nil, status.Errorf(codes.NotFound, "pod sandbox %q not found", req.PodSandboxId)
	}
	return r.RemoteRuntime.PodSandboxStatus(ctx, req)
}

// Stops and removals follow the CRI contract rather than the fake's: they succeed for ids that are
// gone (kubelet repeats them), stopping a sandbox stops its containers, removing it removes them,
// and stopping an exited container keeps its exit code and time. In exec mode a stop ends the
// container's processes (SIGTERM, SIGKILL after the timeout) and the exit code is theirs.
func (r *runtime) StopContainer(_ context.Context, req *runtimeapi.StopContainerRequest) (*runtimeapi.StopContainerResponse, error) {
	if p := r.processOf(req.ContainerId); p != nil {
		p.stop(time.Duration(req.Timeout) * time.Second)
	}
	rs := r.RuntimeService
	rs.Lock()
	defer rs.Unlock()
	if c, ok := rs.Containers[req.ContainerId]; ok {
		stopLocked(c)
	}
	return &runtimeapi.StopContainerResponse{}, nil
}

func (r *runtime) StopPodSandbox(_ context.Context, req *runtimeapi.StopPodSandboxRequest) (*runtimeapi.StopPodSandboxResponse, error) {
	for _, id := range r.containersOf(req.PodSandboxId) {
		if p := r.processOf(id); p != nil {
			p.kill()
		}
	}
	rs := r.RuntimeService
	rs.Lock()
	defer rs.Unlock()
	for _, c := range rs.Containers {
		if c.SandboxID == req.PodSandboxId {
			stopLocked(c)
		}
	}
	if s, ok := rs.Sandboxes[req.PodSandboxId]; ok {
		s.State = runtimeapi.PodSandboxState_SANDBOX_NOTREADY
	}
	return &runtimeapi.StopPodSandboxResponse{}, nil
}

func (r *runtime) RemovePodSandbox(_ context.Context, req *runtimeapi.RemovePodSandboxRequest) (*runtimeapi.RemovePodSandboxResponse, error) {
	r.forget(r.containersOf(req.PodSandboxId))
	rs := r.RuntimeService
	rs.Lock()
	defer rs.Unlock()
	for id, c := range rs.Containers {
		if c.SandboxID == req.PodSandboxId {
			delete(rs.Containers, id)
		}
	}
	delete(rs.Sandboxes, req.PodSandboxId)
	return &runtimeapi.RemovePodSandboxResponse{}, nil
}

// stopLocked ends a container as a process that exits cleanly on SIGTERM would.
func stopLocked(c *apitest.FakeContainer) {
	if c.State != runtimeapi.ContainerState_CONTAINER_EXITED {
		exitLocked(c, 0)
	}
}

// exitLocked records the end of a container's process; the caller holds the RuntimeService lock.
func exitLocked(c *apitest.FakeContainer, code int32) {
	c.State = runtimeapi.ContainerState_CONTAINER_EXITED
	c.ExitCode = code
	c.FinishedAt = time.Now().UnixNano()
	c.Reason = "Error"
	if code == 0 {
		c.Reason = "Completed"
	}
	c.Message = ""
}

type logDevice struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	Permissions   string `json:"permissions"`
}

type logMount struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	Readonly      bool   `json:"readonly"`
}

// logEntry is one line of the CreateContainer log.
type logEntry struct {
	Time         string            `json:"time"`
	PodSandboxID string            `json:"pod_sandbox_id"`
	PodNamespace string            `json:"pod_namespace"`
	PodName      string            `json:"pod_name"`
	PodUID       string            `json:"pod_uid"`
	Container    string            `json:"container"`
	Attempt      uint32            `json:"attempt"`
	Image        string            `json:"image"`
	Envs         map[string]string `json:"envs"`
	Devices      []logDevice       `json:"devices"`
	Mounts       []logMount        `json:"mounts"`
	Annotations  map[string]string `json:"annotations"`
	Labels       map[string]string `json:"labels"`
	CDIDevices   []string          `json:"cdi_devices"`
	CDIEdits     *cdiEdits         `json:"cdi_edits,omitempty"` // exec mode only
	ContainerID  string            `json:"container_id"`
	Error        string            `json:"error"`
}

func (r *runtime) CreateContainer(ctx context.Context, req *runtimeapi.CreateContainerRequest) (*runtimeapi.CreateContainerResponse, error) {
	entry := newLogEntry(req)
	var resp *runtimeapi.CreateContainerResponse
	var l launch
	var err error
	if r.exec != nil {
		var edits cdiEdits
		l, edits, err = r.prepareLaunch(req)
		entry.CDIEdits = &edits
	}
	if err == nil {
		resp, err = r.RemoteRuntime.CreateContainer(ctx, req)
	}
	if err != nil {
		entry.Error = err.Error()
	} else {
		entry.ContainerID = resp.ContainerId
		r.RuntimeService.Lock()
		if c, ok := r.RuntimeService.Containers[resp.ContainerId]; ok {
			c.LogPath = containerLogPath(req)
		}
		if r.exec != nil {
			r.exec.launches[resp.ContainerId] = l
		}
		r.RuntimeService.Unlock()
	}
	if logErr := r.writeLog(entry); logErr != nil && err == nil {
		return nil, status.Errorf(codes.Internal, "writing the CreateContainer log: %v", logErr)
	}
	return resp, err
}

// containerLogPath is where kubelet expects the container's log. The fake leaves it empty, and
// when kubelet removes a container it deletes the files matching "<log path>*", relative to its
// working directory for an empty or relative path. The file is only created in exec mode, where
// the runtime shares kubelet's view of /var/log (its mount namespace).
func containerLogPath(req *runtimeapi.CreateContainerRequest) string {
	dir, name := req.GetSandboxConfig().GetLogDirectory(), req.GetConfig().GetLogPath()
	if path := filepath.Join(dir, name); dir != "" && name != "" && filepath.IsAbs(path) {
		return path
	}
	return filepath.Join("/nonexistent/edl-fake-cri", req.GetPodSandboxId(), req.GetConfig().GetMetadata().GetName()+".log")
}

func newLogEntry(req *runtimeapi.CreateContainerRequest) logEntry {
	config := req.GetConfig()
	labels := config.GetLabels()
	pod := req.GetSandboxConfig().GetMetadata()
	entry := logEntry{
		Time:         time.Now().UTC().Format(time.RFC3339Nano),
		PodSandboxID: req.GetPodSandboxId(),
		PodNamespace: or(pod.GetNamespace(), labels["io.kubernetes.pod.namespace"]),
		PodName:      or(pod.GetName(), labels["io.kubernetes.pod.name"]),
		PodUID:       or(pod.GetUid(), labels["io.kubernetes.pod.uid"]),
		Container:    config.GetMetadata().GetName(),
		Attempt:      config.GetMetadata().GetAttempt(),
		Image:        config.GetImage().GetImage(),
		Envs:         map[string]string{},
		Devices:      []logDevice{},
		Mounts:       []logMount{},
		Annotations:  map[string]string{},
		Labels:       map[string]string{},
		CDIDevices:   []string{},
	}
	for _, env := range config.GetEnvs() {
		entry.Envs[env.GetKey()] = string(env.GetValue())
	}
	for _, d := range config.GetDevices() {
		entry.Devices = append(entry.Devices, logDevice{d.GetContainerPath(), d.GetHostPath(), d.GetPermissions()})
	}
	for _, m := range config.GetMounts() {
		entry.Mounts = append(entry.Mounts, logMount{m.GetContainerPath(), m.GetHostPath(), m.GetReadonly()})
	}
	for k, v := range config.GetAnnotations() {
		entry.Annotations[k] = v
	}
	for k, v := range labels {
		entry.Labels[k] = v
	}
	for _, d := range config.GetCDIDevices() {
		entry.CDIDevices = append(entry.CDIDevices, d.GetName())
	}
	return entry
}

func or(value, fallback string) string {
	if value != "" {
		return value
	}
	return fallback
}

// writeLog appends the entry as one line in one write, so readers never see half a line.
func (r *runtime) writeLog(entry logEntry) error {
	line, err := json.Marshal(entry)
	if err != nil {
		return err
	}
	r.logMu.Lock()
	defer r.logMu.Unlock()
	_, err = r.log.Write(append(line, '\n'))
	return err
}
