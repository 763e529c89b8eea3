package main

import (
	"bytes"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

func TestCopyLogWritesCRILines(t *testing.T) {
	at := time.Date(2026, 11, 26, 10, 0, 0, 123456789, time.UTC)
	var out bytes.Buffer
	long := strings.Repeat("x", 16*1024+5)
	copyLog(&out, &sync.Mutex{}, "stderr", strings.NewReader("one\n\nthree\n"+long+"\nlast"), func() time.Time { return at })
	want := []string{
		"2026-11-26T10:00:00.123456789Z stderr F one",
		"2026-11-26T10:00:00.123456789Z stderr F ",
		"2026-11-26T10:00:00.123456789Z stderr F three",
		"2026-11-26T10:00:00.123456789Z stderr P " + long[:16*1024],
		"2026-11-26T10:00:00.123456789Z stderr F xxxxx",
		"2026-11-26T10:00:00.123456789Z stderr F last",
	}
	if got := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n"); !slices.Equal(got, want) {
		t.Errorf("log lines:\n%q\nwant\n%q", got, want)
	}
}

func TestNthAddress(t *testing.T) {
	for _, tc := range []struct {
		prefix string
		n      uint64
		want   string
	}{
		{"127.64.0.0/16", 1, "127.64.0.1"},
		{"127.64.0.0/16", 256, "127.64.1.0"},
		{"127.64.9.9/16", 65534, "127.64.255.254"},
		{"127.1.2.0/24", 7, "127.1.2.7"},
		{"127.64.0.0/16", 0, ""},
		{"127.64.0.0/16", 65535, ""},
		{"127.1.2.0/30", 3, ""},
		{"::1/120", 1, ""},
	} {
		got, err := nthAddress(netip.MustParsePrefix(tc.prefix), tc.n)
		if tc.want == "" {
			if err == nil {
				t.Errorf("%s #%d: %s, want an error", tc.prefix, tc.n, got)
			}
		} else if err != nil || got.String() != tc.want {
			t.Errorf("%s #%d: %s %v, want %s", tc.prefix, tc.n, got, err, tc.want)
		}
	}
}

func TestMergeEnv(t *testing.T) {
	got := mergeEnv([]string{"A=1", "B=2", "AB=3"}, []string{"B=x", "C=y", "A=", "B=z"})
	if want := []string{"A=", "B=z", "AB=3", "C=y"}; !slices.Equal(got, want) {
		t.Errorf("%q, want %q", got, want)
	}
}

const cdiSpec = `{"cdiVersion": "0.6.0", "kind": "vendor.example/gpu",
 "containerEdits": {"env": ["VENDOR=1"], "deviceNodes": [{"path": "/dev/ctl"}]},
 "devices": [
  {"name": "0", "containerEdits": {"env": ["VISIBLE=0"], "deviceNodes": [{"path": "/dev/gpu0", "hostPath": "/sim/dev/gpu0"}]}},
  {"name": "1", "containerEdits": {"env": ["VISIBLE=1"], "mounts": [{"hostPath": "/sim/lib", "containerPath": "/lib/gpu"}]}}
 ]}`

func writeCDISpec(t *testing.T) string {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "vendor.json"), []byte(cdiSpec), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestResolveCDI(t *testing.T) {
	dir := writeCDISpec(t)
	edits, err := resolveCDI([]string{dir}, []string{"vendor.example/gpu=1", "vendor.example/gpu=0"})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"VENDOR=1", "VISIBLE=1", "VISIBLE=0"}; !slices.Equal(edits.Env, want) {
		t.Errorf("env %q, want %q", edits.Env, want)
	}
	if want := []string{"/dev/ctl:/dev/ctl", "/sim/dev/gpu0:/dev/gpu0"}; !slices.Equal(edits.DeviceNodes, want) {
		t.Errorf("device nodes %q, want %q", edits.DeviceNodes, want)
	}
	if want := []string{"/sim/lib:/lib/gpu"}; !slices.Equal(edits.Mounts, want) {
		t.Errorf("mounts %q, want %q", edits.Mounts, want)
	}
	_, err = resolveCDI([]string{dir, filepath.Join(dir, "absent")}, []string{"vendor.example/gpu=0", "vendor.example/gpu=7"})
	if err == nil || err.Error() != "unresolvable CDI devices vendor.example/gpu=7" {
		t.Errorf("an unknown device: %v", err)
	}
	if edits, err := resolveCDI(nil, nil); err != nil || len(edits.Env) != 0 {
		t.Errorf("no devices: %v %v", edits, err)
	}
}

func TestCDIDeviceNamesFromFieldAndAnnotations(t *testing.T) {
	names, err := cdiDeviceNames(&runtimeapi.ContainerConfig{
		CDIDevices:  []*runtimeapi.CDIDevice{{Name: "vendor.example/gpu=0"}},
		Annotations: map[string]string{"cdi.k8s.io/plugin_x": "vendor.example/gpu=1,vendor.example/gpu=0", "other": "x"},
	})
	if want := []string{"vendor.example/gpu=0", "vendor.example/gpu=1"}; err != nil || !slices.Equal(names, want) {
		t.Errorf("%q %v, want %q", names, err, want)
	}
}

// execSandbox runs a sandbox whose pod logs under a temporary directory.
func (h *harness) execSandbox(name string) (string, *runtimeapi.PodSandboxConfig) {
	h.t.Helper()
	config := &runtimeapi.PodSandboxConfig{
		Metadata:     &runtimeapi.PodSandboxMetadata{Name: name, Namespace: "ns", Uid: "uid-" + name},
		LogDirectory: h.t.TempDir(),
		Hostname:     name,
	}
	resp, err := h.rt.RunPodSandbox(h.ctx, &runtimeapi.RunPodSandboxRequest{Config: config})
	h.must(err)
	return resp.PodSandboxId, config
}

func (h *harness) run(sandboxID string, sandbox *runtimeapi.PodSandboxConfig, script string, cdi ...string) (string, error) {
	h.t.Helper()
	config := &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "main"},
		Image:    &runtimeapi.ImageSpec{Image: "registry.local/app:1"},
		LogPath:  "main/0.log",
		Command:  []string{"/bin/sh", "-c"},
		Args:     []string{script},
		Envs:     []*runtimeapi.KeyValue{{Key: "FROM_KUBELET", Value: []byte("yes")}, {Key: "VISIBLE", Value: []byte("kubelet")}},
		Labels:   map[string]string{"io.kubernetes.pod.namespace": "ns", "io.kubernetes.pod.name": sandbox.Metadata.Name, "io.kubernetes.container.name": "main"},
	}
	for _, name := range cdi {
		config.CDIDevices = append(config.CDIDevices, &runtimeapi.CDIDevice{Name: name})
	}
	created, err := h.rt.CreateContainer(h.ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: sandboxID, Config: config, SandboxConfig: sandbox})
	if err != nil {
		return "", err
	}
	_, err = h.rt.StartContainer(h.ctx, &runtimeapi.StartContainerRequest{ContainerId: created.ContainerId})
	return created.ContainerId, err
}

func (h *harness) waitExited(id string) *runtimeapi.ContainerStatus {
	h.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if s := h.status(id); s.State == runtimeapi.ContainerState_CONTAINER_EXITED {
			return s
		}
		time.Sleep(20 * time.Millisecond)
	}
	h.t.Fatalf("container %s did not exit", id)
	return nil
}

func TestExecRunsTheCommandWithCDIEnvLogAndExitCode(t *testing.T) {
	h := newModeHarness(t, &execConfig{podIPs: netip.MustParsePrefix("127.77.0.0/16"), cdiDirs: []string{writeCDISpec(t)}})
	first, sandbox := h.execSandbox("web")
	second, _ := h.execSandbox("db")
	ips := []string{}
	for _, id := range []string{first, second} {
		resp, err := h.rt.PodSandboxStatus(h.ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: id})
		h.must(err)
		ips = append(ips, resp.Status.Network.Ip)
	}
	if want := []string{"127.77.0.1", "127.77.0.2"}; !slices.Equal(ips, want) {
		t.Errorf("sandbox IPs %q, want %q", ips, want)
	}

	id, err := h.run(first, sandbox, `echo "$FROM_KUBELET $VISIBLE $VENDOR $HOSTNAME"; echo oops >&2; exit 3`, "vendor.example/gpu=0")
	h.must(err)
	s := h.waitExited(id)
	if s.ExitCode != 3 || s.Reason != "Error" || s.FinishedAt == 0 {
		t.Errorf("status %d %q finished %d, want 3 Error", s.ExitCode, s.Reason, s.FinishedAt)
	}
	logFile := filepath.Join(sandbox.LogDirectory, "main", "0.log")
	deadline := time.Now().Add(5 * time.Second)
	var lines []string
	for time.Now().Before(deadline) && len(lines) < 2 {
		data, _ := os.ReadFile(logFile)
		lines = strings.Split(strings.TrimSpace(string(data)), "\n")
		time.Sleep(20 * time.Millisecond)
	}
	var rest []string
	for _, line := range lines {
		stamp, tail, _ := strings.Cut(line, " ")
		if _, err := time.Parse(time.RFC3339Nano, stamp); err != nil {
			t.Errorf("line %q: %v", line, err)
		}
		rest = append(rest, tail)
	}
	slices.Sort(rest) // the two streams are copied independently
	if want := []string{"stderr F oops", "stdout F yes 0 1 web"}; !slices.Equal(rest, want) {
		t.Errorf("log %q, want %q", rest, want)
	}
	entries := readLog(t, h.logPath)
	if got := entries[0]["cdi_edits"]; fmt.Sprint(got) != "map[device_nodes:[/dev/ctl:/dev/ctl /sim/dev/gpu0:/dev/gpu0] env:[VENDOR=1 VISIBLE=0] mounts:[]]" {
		t.Errorf("logged CDI edits %v", got)
	}

	_, err = h.run(first, sandbox, "true", "vendor.example/gpu=9")
	if err == nil || !strings.Contains(err.Error(), "CDI device injection failed: unresolvable CDI devices vendor.example/gpu=9") {
		t.Errorf("an unknown CDI device: %v", err)
	}
	if entries := readLog(t, h.logPath); entries[1]["error"] == "" {
		t.Errorf("the failed CreateContainer is not logged with its error: %v", entries[1])
	}
}

func alive(pid int) bool {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	_, after, _ := strings.Cut(string(data), ") ")
	return !strings.HasPrefix(after, "Z")
}

// pidsIn waits for a file of pids the container writes.
func pidsIn(t *testing.T, path string, count int) []int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		data, _ := os.ReadFile(path)
		if fields := strings.Fields(string(data)); len(fields) == count {
			var pids []int
			for _, f := range fields {
				var pid int
				fmt.Sscan(f, &pid)
				pids = append(pids, pid)
			}
			return pids
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no %d pids in %s", count, path)
	return nil
}

// A container that ignores SIGTERM, with a child and a grandchild in a session of its own: the
// stop signals all of them, kills what is left after the timeout, and reports the signal.
func TestStopEndsTheWholeTree(t *testing.T) {
	h := newModeHarness(t, &execConfig{podIPs: netip.MustParsePrefix("127.77.0.0/16")})
	sandboxID, sandbox := h.execSandbox("web")
	pidFile := filepath.Join(t.TempDir(), "pids")
	script := fmt.Sprintf(`trap '' TERM; sh -c 'setsid sleep 300 & echo $! >> %[1]s; sleep 300' & echo $$ $! >> %[1]s; while :; do sleep 0.05; done`, pidFile)
	id, err := h.run(sandboxID, sandbox, script)
	h.must(err)
	pids := pidsIn(t, pidFile, 3)
	began := time.Now()
	_, err = h.rt.StopContainer(h.ctx, &runtimeapi.StopContainerRequest{ContainerId: id, Timeout: 1})
	h.must(err)
	took := time.Since(began)
	if took < time.Second || took > 5*time.Second {
		t.Errorf("the stop took %s, want the 1 s timeout and a kill", took)
	}
	for _, pid := range pids {
		if alive(pid) {
			t.Errorf("pid %d survived the stop", pid)
		}
	}
	if s := h.status(id); s.ExitCode != 128+int32(syscall.SIGKILL) || s.Reason != "Error" {
		t.Errorf("status %d %q, want 137 Error", s.ExitCode, s.Reason)
	}
}

// A restart is a new container in the same sandbox; removing the sandbox kills what a container
// left behind, and the control API's exit ends the process with the code asked for.
func TestRestartRemoveAndControlExit(t *testing.T) {
	h := newModeHarness(t, &execConfig{podIPs: netip.MustParsePrefix("127.77.0.0/16")})
	sandboxID, sandbox := h.execSandbox("web")
	pidFile := filepath.Join(t.TempDir(), "pids")
	first, err := h.run(sandboxID, sandbox, fmt.Sprintf(`setsid sleep 300 & echo $! >> %s; exit 1`, pidFile))
	h.must(err)
	orphan := pidsIn(t, pidFile, 1)[0]
	if s := h.waitExited(first); s.ExitCode != 1 {
		t.Errorf("first attempt exited %d", s.ExitCode)
	}
	if !alive(orphan) {
		t.Fatal("the orphan should live until its pod goes")
	}
	config := &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "main", Attempt: 1},
		Image:    &runtimeapi.ImageSpec{Image: "registry.local/app:1"},
		LogPath:  "main/1.log",
		Command:  []string{"sleep", "300"},
		Labels:   map[string]string{"io.kubernetes.pod.namespace": "ns", "io.kubernetes.pod.name": "web", "io.kubernetes.container.name": "main"},
	}
	created, err := h.rt.CreateContainer(h.ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: sandboxID, Config: config, SandboxConfig: sandbox})
	h.must(err)
	_, err = h.rt.StartContainer(h.ctx, &runtimeapi.StartContainerRequest{ContainerId: created.ContainerId})
	h.must(err)
	var views []containerView
	h.call("GET", "/containers", "", &views)
	var pid int
	for _, v := range views {
		if v.ID == created.ContainerId {
			pid = v.Pid
		}
	}
	if pid == 0 || !alive(pid) {
		t.Fatalf("no live pid for the second attempt in %+v", views)
	}
	if code, answer := h.exit("main", 42); code != 200 {
		t.Fatalf("exit: %d %v", code, answer)
	}
	if s := h.waitExited(created.ContainerId); s.ExitCode != 42 {
		t.Errorf("second attempt exited %d, want the 42 asked for", s.ExitCode)
	}
	deadline := time.Now().Add(5 * time.Second)
	for alive(pid) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if alive(pid) {
		t.Error("the exited container's process lives on")
	}
	_, err = h.rt.StopPodSandbox(h.ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: sandboxID})
	h.must(err)
	_, err = h.rt.RemovePodSandbox(h.ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: sandboxID})
	h.must(err)
	if alive(orphan) {
		t.Error("a process left by the first attempt survived its pod")
	}
}

func TestNoCommandFailsTheStart(t *testing.T) {
	h := newModeHarness(t, &execConfig{podIPs: netip.MustParsePrefix("127.77.0.0/16")})
	sandboxID, sandbox := h.execSandbox("web")
	config := &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "main"},
		Image:    &runtimeapi.ImageSpec{Image: "registry.local/app:1"},
		Command:  []string{"/nonexistent/binary"},
	}
	created, err := h.rt.CreateContainer(h.ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: sandboxID, Config: config, SandboxConfig: sandbox})
	h.must(err)
	if _, err := h.rt.StartContainer(h.ctx, &runtimeapi.StartContainerRequest{ContainerId: created.ContainerId}); err == nil {
		t.Error("a command that does not exist started")
	}
	if s := h.status(created.ContainerId); s.State != runtimeapi.ContainerState_CONTAINER_EXITED || s.Reason != "StartError" || s.ExitCode != 128 {
		t.Errorf("status %s %q %d, want EXITED StartError 128", s.State, s.Reason, s.ExitCode)
	}
}
