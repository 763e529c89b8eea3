package main

import (
	"fmt"
	"slices"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"tags.cncf.io/container-device-interface/pkg/cdi"
	cdispec "tags.cncf.io/container-device-interface/specs-go"
)

// cdiEdits is what the CDI devices of one CreateContainer request add to the container. Only the
// environment is applied: simulated devices are plain files, so device nodes and mounts are
// recorded in the CreateContainer log and nothing is created.
type cdiEdits struct {
	Env         []string `json:"env"`
	DeviceNodes []string `json:"device_nodes"`
	Mounts      []string `json:"mounts"`
}

// cdiDeviceNames are the CDI devices a request names, in the CDIDevices field (what kubelet
// 1.37 sends) or in cdi.k8s.io/* annotations (what older kubelets sent), each once.
func cdiDeviceNames(config *runtimeapi.ContainerConfig) ([]string, error) {
	var names []string
	for _, d := range config.GetCDIDevices() {
		names = append(names, d.GetName())
	}
	_, annotated, err := cdi.ParseAnnotations(config.GetAnnotations())
	if err != nil {
		return nil, err
	}
	slices.Sort(annotated) // annotations come from a map
	for _, name := range annotated {
		if !slices.Contains(names, name) {
			names = append(names, name)
		}
	}
	return names, nil
}

// resolveCDI reads the specs in dirs afresh and returns the edits of the named devices (their
// specs' edits first, as the library applies them); an unknown name fails with the library's
// own error, as containerd fails CreateContainer.
func resolveCDI(dirs []string, names []string) (cdiEdits, error) {
	edits := cdiEdits{Env: []string{}, DeviceNodes: []string{}, Mounts: []string{}}
	if len(names) == 0 {
		return edits, nil
	}
	cache, err := cdi.NewCache(cdi.WithSpecDirs(dirs...), cdi.WithAutoRefresh(false))
	if err != nil {
		return edits, fmt.Errorf("reading CDI specs from %s: %w", strings.Join(dirs, ", "), err)
	}
	var devices []*cdi.Device
	for _, name := range names {
		device := cache.GetDevice(name)
		if device == nil {
			_, err := cache.InjectDevices(&oci.Spec{}, names...) // only for its error message
			return edits, err
		}
		devices = append(devices, device)
	}
	var seen []*cdi.Spec
	add := func(e *cdispec.ContainerEdits) {
		edits.Env = append(edits.Env, e.Env...)
		for _, d := range e.DeviceNodes {
			edits.DeviceNodes = append(edits.DeviceNodes, or(d.HostPath, d.Path)+":"+d.Path)
		}
		for _, m := range e.Mounts {
			edits.Mounts = append(edits.Mounts, m.HostPath+":"+m.ContainerPath)
		}
	}
	for _, device := range devices {
		if spec := device.GetSpec(); !slices.Contains(seen, spec) {
			seen = append(seen, spec)
			add(&spec.ContainerEdits)
		}
		add(&device.ContainerEdits)
	}
	return edits, nil
}

// mergeEnv sets each KEY=VALUE of edits in env, replacing an entry of the same key in place.
func mergeEnv(env []string, edits []string) []string {
	merged := slices.Clone(env)
	for _, edit := range edits {
		key, _, _ := strings.Cut(edit, "=")
		i := slices.IndexFunc(merged, func(e string) bool { return strings.HasPrefix(e, key+"=") })
		if i >= 0 {
			merged[i] = edit
		} else {
			merged = append(merged, edit)
		}
	}
	return merged
}
