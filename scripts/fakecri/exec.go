package main

import (
	"context"
	"fmt"
	"log"
	"net/netip"
	"os"
	"os/signal"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	apitest "k8s.io/cri-api/pkg/apis/testing"
)

// defaultPath is what containerd gives a container whose image sets no PATH.
const defaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// execConfig turns on exec mode: containers run their command as host processes.
type execConfig struct {
	podIPs  netip.Prefix // each sandbox gets the next address of this range
	cdiDirs []string
}

// execState is exec mode's part of the runtime; its fields are guarded by the RuntimeService
// lock, under which children are also reaped.
type execState struct {
	config   execConfig
	sandboxN uint64
	launches map[string]launch   // by container id, from CreateContainer
	procs    map[string]*process // by container id, from StartContainer
}

func newExecState(config execConfig) (*execState, error) {
	// Processes whose parent dies are reparented to us, and reaped here, not by init.
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return nil, fmt.Errorf("becoming a child subreaper: %w", err)
	}
	return &execState{config: config, launches: map[string]launch{}, procs: map[string]*process{}}, nil
}

func (r *runtime) RunPodSandbox(ctx context.Context, req *runtimeapi.RunPodSandboxRequest) (*runtimeapi.RunPodSandboxResponse, error) {
	resp, err := r.RemoteRuntime.RunPodSandbox(ctx, req)
	if err != nil || r.exec == nil {
		return resp, err
	}
	rs := r.RuntimeService
	rs.Lock()
	defer rs.Unlock()
	r.exec.sandboxN++
	ip, err := nthAddress(r.exec.config.podIPs, r.exec.sandboxN)
	if err != nil {
		delete(rs.Sandboxes, resp.PodSandboxId)
		return nil, status.Error(codes.ResourceExhausted, err.Error())
	}
	rs.Sandboxes[resp.PodSandboxId].Network.Ip = ip.String()
	return resp, nil
}

// prepareLaunch resolves the request's CDI devices and what StartContainer will run.
func (r *runtime) prepareLaunch(req *runtimeapi.CreateContainerRequest) (launch, cdiEdits, error) {
	config := req.GetConfig()
	names, err := cdiDeviceNames(config)
	if err != nil {
		return launch{}, cdiEdits{}, err
	}
	edits, err := resolveCDI(r.exec.config.cdiDirs, names)
	if err != nil {
		return launch{}, edits, fmt.Errorf("CDI device injection failed: %w", err)
	}
	env := []string{defaultPath}
	if host := req.GetSandboxConfig().GetHostname(); host != "" {
		env = append(env, "HOSTNAME="+host)
	}
	for _, kv := range config.GetEnvs() {
		env = mergeEnv(env, []string{kv.GetKey() + "=" + string(kv.GetValue())})
	}
	dir := "/"
	if info, err := os.Stat(config.GetWorkingDir()); err == nil && info.IsDir() {
		dir = config.GetWorkingDir()
	}
	return launch{
		argv:    append(append([]string{}, config.GetCommand()...), config.GetArgs()...),
		env:     mergeEnv(env, edits.Env),
		dir:     dir,
		logPath: containerLogPath(req),
	}, edits, nil
}

func (r *runtime) StartContainer(ctx context.Context, req *runtimeapi.StartContainerRequest) (*runtimeapi.StartContainerResponse, error) {
	if r.exec == nil {
		return r.RemoteRuntime.StartContainer(ctx, req)
	}
	rs := r.RuntimeService
	rs.Lock()
	defer rs.Unlock()
	c, ok := rs.Containers[req.ContainerId]
	l, prepared := r.exec.launches[req.ContainerId]
	if !ok || !prepared {
		return nil, status.Errorf(codes.NotFound, "container %q not found", req.ContainerId)
	}
	if c.State != runtimeapi.ContainerState_CONTAINER_CREATED {
		return nil, status.Errorf(codes.FailedPrecondition, "container %q is %s", req.ContainerId, c.State)
	}
	p, err := startProcess(l)
	if err != nil {
		exitLocked(c, 128)
		c.Reason, c.Message = "StartError", err.Error()
		return nil, status.Errorf(codes.Unknown, "starting container %q: %v", req.ContainerId, err)
	}
	r.exec.procs[req.ContainerId] = p
	c.State = runtimeapi.ContainerState_CONTAINER_RUNNING
	c.StartedAt = time.Now().UnixNano()
	log.Printf("started container %s: pid %d, %q", req.ContainerId, p.pid, l.argv)
	return &runtimeapi.StartContainerResponse{}, nil
}

// reap waits for every child (container processes and the orphans reparented to us) until done,
// recording the exit of containers' first processes.
func (r *runtime) reap(done <-chan struct{}) {
	children := make(chan os.Signal, 1)
	signal.Notify(children, syscall.SIGCHLD)
	defer signal.Stop(children)
	tick := time.NewTicker(time.Second) // a safety net; SIGCHLD does the work
	defer tick.Stop()
	for {
		r.reapExited()
		select {
		case <-done:
			return
		case <-children:
		case <-tick.C:
		}
	}
}

func (r *runtime) reapExited() {
	rs := r.RuntimeService
	rs.Lock()
	defer rs.Unlock()
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if err != nil || pid <= 0 {
			return
		}
		for id, p := range r.exec.procs {
			if p.pid != pid {
				continue
			}
			close(p.exited)
			p.pid = 0 // the number may be reused from now on
			// A container made to exit through the control API keeps the code it was given.
			if c, ok := rs.Containers[id]; ok && c.State == runtimeapi.ContainerState_CONTAINER_RUNNING {
				exitLocked(c, exitCode(ws))
			}
			log.Printf("container %s: pid %d exited with %d", id, pid, exitCode(ws))
		}
	}
}

// processOf is the started process of a container, if any.
func (r *runtime) processOf(id string) *process {
	if r.exec == nil {
		return nil
	}
	r.RuntimeService.Lock()
	defer r.RuntimeService.Unlock()
	return r.exec.procs[id]
}

// forget stops what is left of a removed container and lets its namespace go.
func (r *runtime) forget(ids []string) {
	if r.exec == nil {
		return
	}
	for _, id := range ids {
		if p := r.processOf(id); p != nil {
			p.kill()
			p.release()
		}
	}
	rs := r.RuntimeService
	rs.Lock()
	defer rs.Unlock()
	for _, id := range ids {
		delete(r.exec.procs, id)
		delete(r.exec.launches, id)
	}
}

// containersOf lists the ids of a sandbox's containers.
func (r *runtime) containersOf(sandboxID string) []string {
	rs := r.RuntimeService
	rs.Lock()
	defer rs.Unlock()
	var ids []string
	for id, c := range rs.Containers {
		if c.SandboxID == sandboxID {
			ids = append(ids, id)
		}
	}
	return ids
}

func (r *runtime) RemoveContainer(ctx context.Context, req *runtimeapi.RemoveContainerRequest) (*runtimeapi.RemoveContainerResponse, error) {
	r.forget([]string{req.ContainerId})
	return r.RemoteRuntime.RemoveContainer(ctx, req)
}

// killAll ends every container's processes: none outlives the runtime.
func (r *runtime) killAll() {
	if r.exec == nil {
		return
	}
	r.RuntimeService.Lock()
	procs := make([]*process, 0, len(r.exec.procs))
	for _, p := range r.exec.procs {
		procs = append(procs, p)
	}
	r.RuntimeService.Unlock()
	for _, p := range procs {
		p.signal(syscall.SIGKILL)
	}
	for _, p := range procs {
		p.kill()
		p.release()
	}
}

// killLocked makes a container's processes die at once (the control API's exit); the caller
// holds the lock, so nothing is awaited.
func (r *runtime) killLocked(c *apitest.FakeContainer) {
	if r.exec != nil {
		if p := r.exec.procs[c.Id]; p != nil {
			p.signal(syscall.SIGKILL)
		}
	}
}
