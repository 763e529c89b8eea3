package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

type harness struct {
	t       *testing.T
	ctx     context.Context
	rt      runtimeapi.RuntimeServiceClient
	img     runtimeapi.ImageServiceClient
	control *http.Client
	logPath string
}

func newHarness(t *testing.T) *harness { return newModeHarness(t, nil) }

// newModeHarness serves the runtime in exec mode when execMode is given.
func newModeHarness(t *testing.T, execMode *execConfig) *harness {
	// Unix socket paths are limited to 107 bytes; t.TempDir() can be longer.
	dir, err := os.MkdirTemp("", "fakecri")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	socket, control := filepath.Join(dir, "cri.sock"), filepath.Join(dir, "control.sock")
	logPath := filepath.Join(dir, "cri.jsonl")
	if err := os.WriteFile(socket, nil, 0o600); err != nil { // a stale socket file
		t.Fatal(err)
	}
	srv, err := start(socket, control, logPath, "/", execMode)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		srv.stop()
		for _, path := range []string{socket, control} {
			if _, err := os.Stat(path); err == nil {
				t.Errorf("%s is still there after stop", path)
			}
		}
	})
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return &harness{
		t: t, ctx: ctx, logPath: logPath,
		rt:  runtimeapi.NewRuntimeServiceClient(conn),
		img: runtimeapi.NewImageServiceClient(conn),
		control: &http.Client{Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, "unix", control)
			},
		}},
	}
}

func (h *harness) must(err error) {
	h.t.Helper()
	if err != nil {
		h.t.Fatal(err)
	}
}

// call sends a control request and decodes the JSON answer into out.
func (h *harness) call(method, path, body string, out any) int {
	h.t.Helper()
	req, err := http.NewRequestWithContext(h.ctx, method, "http://fakecri"+path, strings.NewReader(body))
	h.must(err)
	resp, err := h.control.Do(req)
	h.must(err)
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	h.must(err)
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			h.t.Fatalf("%s %s: %v in %q", method, path, err, data)
		}
	}
	return resp.StatusCode
}

func (h *harness) exit(container string, code int) (int, map[string]any) {
	h.t.Helper()
	body, _ := json.Marshal(map[string]any{"namespace": "ns", "pod": "web", "container": container, "code": code})
	var answer map[string]any
	return h.call("POST", "/exit", string(body), &answer), answer
}

func (h *harness) createAndStart(sandboxID string, sandbox *runtimeapi.PodSandboxConfig, attempt uint32) string {
	h.t.Helper()
	resp, err := h.rt.CreateContainer(h.ctx, &runtimeapi.CreateContainerRequest{
		PodSandboxId:  sandboxID,
		SandboxConfig: sandbox,
		Config: &runtimeapi.ContainerConfig{
			Metadata: &runtimeapi.ContainerMetadata{Name: "main", Attempt: attempt},
			Image:    &runtimeapi.ImageSpec{Image: "registry.local/app:1"},
			LogPath:  fmt.Sprintf("main/%d.log", attempt),
			Envs: []*runtimeapi.KeyValue{
				{Key: "EDL_VISIBLE_DEVICES", Value: []byte("0,1")},
				{Key: "EMPTY", Value: nil},
			},
			Devices: []*runtimeapi.Device{
				{ContainerPath: "/dev/accel0", HostPath: "/dev/accel0", Permissions: "rw"},
			},
			Mounts: []*runtimeapi.Mount{
				{ContainerPath: "/etc/edl", HostPath: "/var/lib/edl/pod", Readonly: true},
				{ContainerPath: "/data", HostPath: "/srv/data"},
			},
			Annotations: map[string]string{"io.kubernetes.container.restartCount": "0"},
			Labels: map[string]string{
				"io.kubernetes.pod.namespace":  "ns",
				"io.kubernetes.pod.name":       "web",
				"io.kubernetes.pod.uid":        "uid-1",
				"io.kubernetes.container.name": "main",
			},
			CDIDevices: []*runtimeapi.CDIDevice{{Name: "edl.example/accel=0"}},
		},
	})
	h.must(err)
	_, err = h.rt.StartContainer(h.ctx, &runtimeapi.StartContainerRequest{ContainerId: resp.ContainerId})
	h.must(err)
	return resp.ContainerId
}

func (h *harness) status(id string) *runtimeapi.ContainerStatus {
	h.t.Helper()
	resp, err := h.rt.ContainerStatus(h.ctx, &runtimeapi.ContainerStatusRequest{ContainerId: id})
	h.must(err)
	return resp.Status
}

func (h *harness) listIDs(state runtimeapi.ContainerState) []string {
	h.t.Helper()
	resp, err := h.rt.ListContainers(h.ctx, &runtimeapi.ListContainersRequest{
		Filter: &runtimeapi.ContainerFilter{State: &runtimeapi.ContainerStateValue{State: state}},
	})
	h.must(err)
	ids := []string{}
	for _, c := range resp.Containers {
		ids = append(ids, c.Id)
	}
	return ids
}

func TestKubeletStartup(t *testing.T) {
	h := newHarness(t)
	version, err := h.rt.Version(h.ctx, &runtimeapi.VersionRequest{Version: "0.1.0"})
	h.must(err)
	if version.Version != "0.1.0" || version.RuntimeApiVersion != "v1" || version.RuntimeName == "" {
		t.Errorf("Version: %v", version)
	}
	st, err := h.rt.Status(h.ctx, &runtimeapi.StatusRequest{})
	h.must(err)
	if len(st.Status.GetConditions()) != 2 || !st.Status.Conditions[0].Status || !st.Status.Conditions[1].Status {
		t.Errorf("Status: %v", st)
	}
	config, err := h.rt.RuntimeConfig(h.ctx, &runtimeapi.RuntimeConfigRequest{})
	h.must(err)
	if config.GetLinux().GetCgroupDriver() != runtimeapi.CgroupDriver_CGROUPFS {
		t.Errorf("RuntimeConfig: %v", config)
	}
	fsInfo, err := h.img.ImageFsInfo(h.ctx, &runtimeapi.ImageFsInfoRequest{})
	h.must(err)
	if fsInfo.ImageFilesystems[0].FsId.Mountpoint != "/" || fsInfo.ContainerFilesystems[0].FsId.Mountpoint != "/" {
		t.Errorf("ImageFsInfo: %v", fsInfo)
	}
	image := &runtimeapi.ImageSpec{Image: "registry.local/app:1"}
	_, err = h.img.PullImage(h.ctx, &runtimeapi.PullImageRequest{Image: image})
	h.must(err)
	imageStatus, err := h.img.ImageStatus(h.ctx, &runtimeapi.ImageStatusRequest{Image: image})
	h.must(err)
	if imageStatus.Image.GetId() == "" || imageStatus.Image.GetSize() == 0 {
		t.Errorf("ImageStatus: %v", imageStatus)
	}
}

func TestExitOnDemand(t *testing.T) {
	h := newHarness(t)
	sandboxConfig := &runtimeapi.PodSandboxConfig{
		Metadata:     &runtimeapi.PodSandboxMetadata{Name: "web", Namespace: "ns", Uid: "uid-1"},
		Labels:       map[string]string{"io.kubernetes.pod.uid": "uid-1"},
		LogDirectory: "/var/log/pods/ns_web_uid-1",
	}
	sandbox, err := h.rt.RunPodSandbox(h.ctx, &runtimeapi.RunPodSandboxRequest{Config: sandboxConfig})
	h.must(err)
	sandboxStatus, err := h.rt.PodSandboxStatus(h.ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: sandbox.PodSandboxId})
	h.must(err)
	if ip := sandboxStatus.Status.GetNetwork().GetIp(); !strings.HasPrefix(ip, "127.0.0.") {
		t.Errorf("pod IP %q is not a loopback address", ip)
	}

	first := h.createAndStart(sandbox.PodSandboxId, sandboxConfig, 0)
	running := h.status(first)
	if running.State != runtimeapi.ContainerState_CONTAINER_RUNNING || running.StartedAt == 0 {
		t.Fatalf("after StartContainer: %v", running)
	}
	if running.LogPath != "/var/log/pods/ns_web_uid-1/main/0.log" {
		t.Errorf("log path %q", running.LogPath)
	}

	code, answer := h.exit("main", 137)
	if code != http.StatusOK || answer["id"] != first || answer["attempt"] != 0.0 {
		t.Fatalf("exit: %d %v", code, answer)
	}
	if ids := h.listIDs(runtimeapi.ContainerState_CONTAINER_EXITED); len(ids) != 1 || ids[0] != first {
		t.Errorf("exited containers: %v", ids)
	}
	if ids := h.listIDs(runtimeapi.ContainerState_CONTAINER_RUNNING); len(ids) != 0 {
		t.Errorf("running containers: %v", ids)
	}
	exited := h.status(first)
	if exited.State != runtimeapi.ContainerState_CONTAINER_EXITED || exited.ExitCode != 137 || exited.Reason != "Error" ||
		exited.FinishedAt == 0 || exited.StartedAt != running.StartedAt || exited.Message != "" {
		t.Errorf("after exit: %v", exited)
	}
	if _, err := h.rt.ListPodSandbox(h.ctx, &runtimeapi.ListPodSandboxRequest{}); err != nil {
		t.Error(err)
	}

	code, answer = h.exit("main", 1)
	if code != http.StatusNotFound || !strings.Contains(answer["error"].(string), "main attempt 0 CONTAINER_EXITED (exit code 137)") {
		t.Errorf("exit with no running container: %d %v", code, answer)
	}
	if containers := answer["containers"].([]any); len(containers) != 1 {
		t.Errorf("containers in the 404 answer: %v", containers)
	}
	if code, _ := h.exit("sidecar", 1); code != http.StatusNotFound {
		t.Errorf("exit of an unknown container: %d", code)
	}
	for _, body := range []string{"{", `{"namespace":"ns","pod":"web","container":"main"}`, `{"pod":"web","container":"main","code":1}`} {
		if code := h.call("POST", "/exit", body, nil); code != http.StatusBadRequest {
			t.Errorf("exit %s: %d, want 400", body, code)
		}
	}

	// kubelet restarts the container: attempt 1 in the same sandbox.
	second := h.createAndStart(sandbox.PodSandboxId, sandboxConfig, 1)
	code, answer = h.exit("main", 3)
	if code != http.StatusOK || answer["id"] != second || answer["attempt"] != 1.0 {
		t.Fatalf("exit of attempt 1: %d %v", code, answer)
	}
	if s := h.status(second); s.ExitCode != 3 || s.Reason != "Error" {
		t.Errorf("attempt 1 after exit: %v", s)
	}
	if s := h.status(first); s.ExitCode != 137 {
		t.Errorf("attempt 0 changed: %v", s)
	}
	third := h.createAndStart(sandbox.PodSandboxId, sandboxConfig, 2)
	if code, answer := h.exit("main", 0); code != http.StatusOK || answer["id"] != third {
		t.Errorf("exit of attempt 2: %d %v", code, answer)
	}
	if s := h.status(third); s.ExitCode != 0 || s.Reason != "Completed" {
		t.Errorf("attempt 2 after exit 0: %v", s)
	}

	var views []containerView
	if code := h.call("GET", "/containers", "", &views); code != http.StatusOK || len(views) != 3 ||
		views[0].ID != first || views[0].ExitCode != 137 || views[0].State != "CONTAINER_EXITED" ||
		views[1].Attempt != 1 || views[1].Namespace != "ns" || views[1].Pod != "web" || views[1].SandboxID != sandbox.PodSandboxId {
		t.Errorf("containers: %d %+v", code, views)
	}
	var health string
	req, _ := http.NewRequest("GET", "http://fakecri/healthz", nil)
	if resp, err := h.control.Do(req); err != nil || resp.StatusCode != http.StatusOK {
		t.Errorf("healthz: %v %v", resp, err)
	} else {
		data, _ := io.ReadAll(resp.Body)
		health = string(data)
		_ = resp.Body.Close()
	}
	if health != "ok" {
		t.Errorf("healthz answered %q", health)
	}

	entries := readLog(t, h.logPath)
	if len(entries) != 3 {
		t.Fatalf("%d log lines, want 3", len(entries))
	}
	entry := entries[0]
	want := map[string]any{
		"pod_sandbox_id": sandbox.PodSandboxId, "pod_namespace": "ns", "pod_name": "web", "pod_uid": "uid-1",
		"container": "main", "attempt": 0.0, "image": "registry.local/app:1", "container_id": first, "error": "",
	}
	for key, value := range want {
		if entry[key] != value {
			t.Errorf("log %s = %v, want %v", key, entry[key], value)
		}
	}
	if entries[1]["attempt"] != 1.0 || entries[1]["container_id"] != second {
		t.Errorf("second log line: %v", entries[1])
	}
	if stamp, err := time.Parse(time.RFC3339Nano, entry["time"].(string)); err != nil || time.Since(stamp) > time.Minute {
		t.Errorf("log time %v: %v", entry["time"], err)
	}
	checkJSON(t, "envs", entry["envs"], `{"EDL_VISIBLE_DEVICES":"0,1","EMPTY":""}`)
	checkJSON(t, "devices", entry["devices"], `[{"container_path":"/dev/accel0","host_path":"/dev/accel0","permissions":"rw"}]`)
	checkJSON(t, "mounts", entry["mounts"],
		`[{"container_path":"/etc/edl","host_path":"/var/lib/edl/pod","readonly":true},{"container_path":"/data","host_path":"/srv/data","readonly":false}]`)
	checkJSON(t, "annotations", entry["annotations"], `{"io.kubernetes.container.restartCount":"0"}`)
	checkJSON(t, "cdi_devices", entry["cdi_devices"], `["edl.example/accel=0"]`)
	if labels := entry["labels"].(map[string]any); labels["io.kubernetes.pod.uid"] != "uid-1" || len(labels) != 4 {
		t.Errorf("log labels: %v", labels)
	}
}

func TestEmptyFieldsAndLabelFallback(t *testing.T) {
	h := newHarness(t)
	sandbox, err := h.rt.RunPodSandbox(h.ctx, &runtimeapi.RunPodSandboxRequest{Config: &runtimeapi.PodSandboxConfig{
		Metadata: &runtimeapi.PodSandboxMetadata{Name: "p", Namespace: "n", Uid: "u"},
	}})
	h.must(err)
	_, err = h.rt.CreateContainer(h.ctx, &runtimeapi.CreateContainerRequest{
		PodSandboxId: sandbox.PodSandboxId,
		Config: &runtimeapi.ContainerConfig{
			Metadata: &runtimeapi.ContainerMetadata{Name: "c"},
			Image:    &runtimeapi.ImageSpec{Image: "i"},
			Labels:   map[string]string{"io.kubernetes.pod.namespace": "n", "io.kubernetes.pod.name": "p", "io.kubernetes.pod.uid": "u"},
		},
	})
	h.must(err)
	entries := readLog(t, h.logPath)
	if len(entries) != 1 {
		t.Fatalf("%d log lines", len(entries))
	}
	line, _ := json.Marshal(entries[0])
	for _, part := range []string{`"pod_namespace":"n"`, `"pod_name":"p"`, `"pod_uid":"u"`, `"envs":{}`, `"devices":[]`,
		`"mounts":[]`, `"annotations":{}`, `"cdi_devices":[]`} {
		if !bytes.Contains(line, []byte(part)) {
			t.Errorf("log line %s lacks %s", line, part)
		}
	}
}

func TestStopAndRemoveAreIdempotent(t *testing.T) {
	h := newHarness(t)
	sandboxConfig := &runtimeapi.PodSandboxConfig{Metadata: &runtimeapi.PodSandboxMetadata{Name: "web", Namespace: "ns", Uid: "uid-1"}}
	sandbox, err := h.rt.RunPodSandbox(h.ctx, &runtimeapi.RunPodSandboxRequest{Config: sandboxConfig})
	h.must(err)
	id := h.createAndStart(sandbox.PodSandboxId, sandboxConfig, 0)
	_, err = h.rt.StopContainer(h.ctx, &runtimeapi.StopContainerRequest{ContainerId: id, Timeout: 30})
	h.must(err)
	if s := h.status(id); s.State != runtimeapi.ContainerState_CONTAINER_EXITED || s.FinishedAt == 0 || s.Reason != "Completed" {
		t.Errorf("after StopContainer: %v", s)
	}
	// Kubelet deletes "<log path>*" when it removes a container: never an empty or relative path.
	if path := h.status(id).LogPath; !strings.HasPrefix(path, "/nonexistent/") {
		t.Errorf("log path %q without a log directory", path)
	}

	other := h.createAndStart(sandbox.PodSandboxId, sandboxConfig, 1)
	if code, _ := h.exit("main", 42); code != http.StatusOK {
		t.Fatal(code)
	}
	finished := h.status(other).FinishedAt
	_, err = h.rt.StopContainer(h.ctx, &runtimeapi.StopContainerRequest{ContainerId: other})
	h.must(err)
	if s := h.status(other); s.ExitCode != 42 || s.FinishedAt != finished {
		t.Errorf("StopContainer changed an exited container: %v", s)
	}

	third := h.createAndStart(sandbox.PodSandboxId, sandboxConfig, 2)
	_, err = h.rt.StopPodSandbox(h.ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: sandbox.PodSandboxId})
	h.must(err)
	if s := h.status(third); s.State != runtimeapi.ContainerState_CONTAINER_EXITED {
		t.Errorf("StopPodSandbox left a container %v", s.State)
	}
	for range 2 {
		_, err = h.rt.StopContainer(h.ctx, &runtimeapi.StopContainerRequest{ContainerId: "gone"})
		h.must(err)
		_, err = h.rt.RemoveContainer(h.ctx, &runtimeapi.RemoveContainerRequest{ContainerId: "gone"})
		h.must(err)
		_, err = h.rt.StopPodSandbox(h.ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: "gone"})
		h.must(err)
		_, err = h.rt.RemovePodSandbox(h.ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: sandbox.PodSandboxId})
		h.must(err)
	}
	if ids := h.listIDs(runtimeapi.ContainerState_CONTAINER_EXITED); len(ids) != 0 {
		t.Errorf("RemovePodSandbox left containers %v", ids)
	}
	_, err = h.rt.ContainerStatus(h.ctx, &runtimeapi.ContainerStatusRequest{ContainerId: id})
	if status.Code(err) != codes.NotFound {
		t.Errorf("ContainerStatus of a removed container: %v", err)
	}
	_, err = h.rt.PodSandboxStatus(h.ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: sandbox.PodSandboxId})
	if status.Code(err) != codes.NotFound {
		t.Errorf("PodSandboxStatus of a removed sandbox: %v", err)
	}
}

func readLog(t *testing.T, path string) []map[string]any {
	t.Helper()
	file, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	var entries []map[string]any
	scanner := bufio.NewScanner(file)
	for scanner.Scan() {
		var entry map[string]any
		if err := json.Unmarshal(scanner.Bytes(), &entry); err != nil {
			t.Fatalf("log line %q: %v", scanner.Text(), err)
		}
		entries = append(entries, entry)
	}
	return entries
}

func checkJSON(t *testing.T, name string, got any, want string) {
	t.Helper()
	data, _ := json.Marshal(got)
	var normal any
	_ = json.Unmarshal([]byte(want), &normal)
	wantData, _ := json.Marshal(normal)
	if !bytes.Equal(data, wantData) {
		t.Errorf("log %s = %s, want %s", name, data, wantData)
	}
}
